"""A prompt timeline: prompts that start at given blocks, and what each block is conditioned on and scored against.

Text form (CLI ``--prompt-schedule``): ``"0:a fox in snow|4:the fox jumps"``; or a JSON file: a list of
``{"block": 0, "prompt": "..."}`` objects, or an object ``{"0": "...", "4": "..."}``. The first prompt starts at
block 0; blocks strictly increase.

Rules (one home for them; the sampler and the denoisers ask this object):

- **Conditioning.** Block b is denoised under the prompt in force at b. With ``blend_blocks = N`` the text
  embeddings are interpolated over the N blocks after a switch (Krea): block ``s + k`` (k < N) gets
  ``lerp(old, new, (k + 1) / (N + 1))``, block ``s + N`` the new prompt alone. Each distinct conditioning gets its
  cross-attention K/V computed once per model: one re-initialisation per switch (N + 1 with blending).
- **Caches.** A block's K/V are always computed under that block's own conditioning: history a cache catches up on
  (global clean passes, noisy writes) is written under the prompt it was made with, so a deferred write, a
  pipelined draft and a plain run agree. The recompute regime rebuilds its window before every block, under the
  block's prompt: that is LongLive's re-cache, for free. (A re-cache of the noisy and global windows at a switch
  is not offered yet: those caches keep the K/V their blocks were made with.)
- **Scoring.** The reward model scores every block against the prompt in force (during a blend, the new one).
- **Relative τ.** ``threshold="relative"`` compares drafts with the target's score of a reference block; scores
  against a new prompt are not comparable with the old reference, so the first block after a switch is made by
  the target and its score is the new reference (the same rule as block 0).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError


def check_prompt(prompt, what: str = "--prompt") -> str:
    """A prompt must say something: an empty or whitespace-only one is refused (it would generate from no text)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{what} is empty; describe the video to generate (e.g. \"a fox running through snow\").")
    return prompt


@dataclass(frozen=True)
class PromptSegment:
    start: int  # the first block of this prompt
    prompt: str


@dataclass(eq=False)
class PromptSchedule:
    segments: tuple[PromptSegment, ...]
    blend_blocks: int = 0
    _embeds: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.segments = tuple(self.segments)
        if not self.segments:
            raise ConfigError("The prompt schedule is empty; give at least '0:your prompt'.")
        if self.segments[0].start != 0:
            raise ConfigError(f"The prompt schedule must start at block 0 (it starts at {self.segments[0].start}).")
        for a, b in zip(self.segments, self.segments[1:], strict=False):
            if b.start <= a.start:
                raise ConfigError(f"Prompt schedule blocks must increase: block {b.start} comes after block {a.start}.")
        for seg in self.segments:
            if not isinstance(seg.prompt, str) or not seg.prompt.strip():
                raise ConfigError(f"The prompt starting at block {seg.start} is empty.")
        if isinstance(self.blend_blocks, bool) or not isinstance(self.blend_blocks, int) or self.blend_blocks < 0:
            raise ConfigError(f"blend_blocks must be a whole number >= 0, got {self.blend_blocks!r}.")

    # ---- building --------------------------------------------------------------------------------------------
    @classmethod
    def single(cls, prompt: str) -> PromptSchedule:
        return cls((PromptSegment(0, prompt),))

    @classmethod
    def parse(cls, text: str, **kw) -> PromptSchedule:
        """``"0:a fox|4:the fox jumps"``, or the path of a JSON file (see the module docstring)."""
        text = text.strip()
        path = Path(text).expanduser()
        if text.endswith(".json"):
            if not path.is_file():
                raise ConfigError(f"Prompt schedule file {text} does not exist.")
            return cls.from_json(json.loads(path.read_text(encoding="utf-8")), **kw)
        segments = []
        for part in text.split("|"):
            block, sep, prompt = part.partition(":")
            if not sep or not block.strip().isdigit():
                raise ConfigError(f"Prompt schedule entry {part.strip()!r} must be 'BLOCK:prompt', e.g. '0:a fox in "
                                  "snow|4:the fox jumps'.")
            segments.append(PromptSegment(int(block), prompt.strip()))
        return cls(tuple(segments), **kw)

    @classmethod
    def from_json(cls, data, **kw) -> PromptSchedule:
        try:
            if isinstance(data, dict):
                items = [(int(k), v) for k, v in data.items()]
            else:
                items = [(int(d["block"]), d["prompt"]) for d in data]
        except (TypeError, ValueError, KeyError) as exc:
            raise ConfigError('A prompt schedule JSON is [{"block": 0, "prompt": "..."}, ...] or {"0": "...", '
                              f'"4": "..."}}; got {type(data).__name__} ({exc}).') from exc
        return cls(tuple(PromptSegment(b, p) for b, p in sorted(items)), **kw)

    def check_blocks(self, num_blocks: int) -> None:
        late = [s.start for s in self.segments if s.start >= num_blocks]
        if late:
            raise ConfigError(f"The prompt schedule starts a prompt at block {late[0]} but the video has {num_blocks} "
                              "block(s) (0.." f"{num_blocks - 1}).")

    # ---- questions ---------------------------------------------------------------------------------------------
    @property
    def switches(self) -> list[int]:
        return [s.start for s in self.segments[1:]]

    def segment_of(self, block: int) -> int:
        return max(i for i, s in enumerate(self.segments) if s.start <= block)

    def prompt_at(self, block: int) -> str:
        """The prompt in force at ``block`` (what the reward model scores it against)."""
        return self.segments[self.segment_of(block)].prompt

    def conditioning_key(self, block: int) -> tuple[int, int]:
        """Blocks with equal keys share their conditioning: (segment, blend step; 0 once fully switched)."""
        i = self.segment_of(block)
        k = block - self.segments[i].start
        return (i, k + 1) if i > 0 and k < self.blend_blocks else (i, 0)

    # ---- embeddings ----------------------------------------------------------------------------------------------
    def encode(self, encode: Callable[[str], torch.Tensor], given: Sequence[torch.Tensor] | None = None) -> None:
        """Embed every prompt once (``given``: precomputed embeddings, one per segment)."""
        if given is not None:
            if len(given) != len(self.segments):
                raise ConfigError(f"{len(given)} prompt embeddings for {len(self.segments)} scheduled prompts.")
            self._embeds = list(given)
        else:
            self._embeds = [encode(s.prompt) for s in self.segments]

    @property
    def embeddings(self) -> list[torch.Tensor]:
        return list(self._embeds)

    def embeds_for(self, key: tuple[int, int]) -> torch.Tensor:
        i, step = key
        new = self._embeds[i]
        if step == 0:
            return new
        old = self._embeds[i - 1].to(new.device, new.dtype)
        return torch.lerp(old, new, step / (self.blend_blocks + 1))

    def to_dict(self) -> dict:
        return {"segments": [{"block": s.start, "prompt": s.prompt} for s in self.segments],
                "blend_blocks": self.blend_blocks}
