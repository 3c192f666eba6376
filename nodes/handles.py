"""What travels on the SDVG sockets. Plain dataclasses (no ComfyUI import), immutable by convention:
a node that needs a variant builds a new one with ``dataclasses.replace`` and never edits its input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

OFFLOAD_POLICIES = ("keep_loaded", "offload_to_cpu_when_idle")


@dataclass(frozen=True)
class DiTHandle:
    """SDVG_DIT: a causal Wan DiT. The sampler input it is wired to (drafter / target) gives its role.

    A handle is a recipe until a run needs the model: ``source(handle)`` loads it (through ComfyUI's memory manager,
    ``nodes/_models.py``) the first time ``model`` or ``managed`` is read, and the handle then holds it. So a chain
    *SDVG Load Video DiT → SDVG Load LoRA → …* reads the file once, with every LoRA merged on the way in, and a
    DiT nobody samples with is never loaded. ``loras``: (path, strength) in order; ``block_offload``: None, "auto"
    or K resident blocks."""

    file: str
    dtype: str
    device: torch.device
    offload: str = "keep_loaded"
    loras: tuple[tuple[str, float], ...] = ()
    block_offload: int | str | None = None
    source: Callable[[DiTHandle], Any] | None = field(default=None, compare=False, repr=False)
    lora_base: str | None = None  # the file LoRAs are merged into (None: LoRAs cannot be added, e.g. a core MODEL)
    _held: list = field(default_factory=list, compare=False, repr=False)

    @property
    def managed(self) -> Any:
        if not self._held:
            if self.source is None:
                raise RuntimeError("This SDVG_DIT has no model and no way to load one.")
            self._held.append(self.source(self))
        return self._held[0]

    @property
    def model(self) -> Any:
        return self.managed.model

    def loaded(self) -> Any | None:
        """The managed model if it was loaded, without loading it."""
        return self._held[0] if self._held else None

    def with_lora(self, path: str, strength: float) -> DiTHandle:
        """A new recipe with one more LoRA (this handle, and what it loaded, stay as they are)."""
        return replace(self, loras=(*self.loras, (path, float(strength))), _held=[])

    @classmethod
    def of(cls, managed: Any, *, file: str, dtype: str, device: torch.device, offload: str = "keep_loaded") -> DiTHandle:
        """A handle for a model that is already loaded."""
        return cls(file=file, dtype=dtype, device=device, offload=offload, _held=[managed])


@dataclass(frozen=True)
class AuxHandle:
    """SDVG_TEXT_ENCODER / SDVG_VAE / SDVG_REWARD: a loaded helper model and where it lives."""

    model: Any
    file: str
    device: torch.device
    kind: str
    managed: Any = None


@dataclass(frozen=True)
class SDVGConditioning:
    """SDVG_CONDITIONING: UMT5 embeddings ``[1, 512, text_dim]`` (padding zeroed) + the prompt text for the reward."""

    embeds: torch.Tensor
    prompt: str
    source: str = "sdvg"  # "sdvg" (our text encoder) or "comfy" (native CONDITIONING)
    extra: dict = field(default_factory=dict)
    schedule: Any = None  # SDVG Prompt Schedule: the engine's PromptSchedule (embeddings encoded); embeds = block 0's

    def sampler_prompt(self) -> tuple[Any, Any]:
        """What ``SpeculativeSampler.run`` takes: (prompt or PromptSchedule, prompt_embeds)."""
        if self.schedule is not None:
            return self.schedule, self.schedule.embeddings
        return self.prompt, self.embeds
