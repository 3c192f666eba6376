"""Wan 2.1 LoRAs merged into a DiT while it loads: each weight gets its delta on its way to the device, in fp32 and
before any fp8 conversion, so no second copy of the model is ever held.

Accepted files (``.safetensors``, or torch pickles read with ``weights_only=True``) in the key layouts users have:
kohya / ComfyUI, VideoX-Fun, LyCORIS naming (SimpleTuner, ai-toolkit), diffusers / PEFT, original Wan keys,
DiffSynth / UniAnimate pipelines, full deltas (``.diff``, ``.diff_b``, WanVideoWrapper's ``.diff_m``) — what each key
means is ``lora_keys.py``. Keys for parts a T2V DiT lacks (I2V layers, a text encoder) are skipped with a warning
naming them, or refused with ``LoraSpec(strict=True)``.

Module names are matched through the same original ↔ diffusers name map the DiT loader uses
(:func:`wan_keys.diffusers_to_original_key`, the inverse of diffusers' own converter), on names only. We do not use
diffusers' ``_convert_non_diffusers_wan_lora_to_diffusers``: it rescales the factors by alpha in their stored dtype
and silently drops some keys (norm diffs), where a merge at load time wants the factors as stored and every key
accounted for.

The merge of one weight ``W`` is ``W.float() + Σ_i strength_i · (alpha_i / rank_i) · (up_i.float() @ down_i.float())``
(plus ``strength_i · diff_i`` for full deltas), then the loader converts it to the model's dtype. A key that maps to
nothing in the DiT (and is no I2V / text-encoder key), a LoRA for another width, and LoRA variants we do not merge
(LoCon mid, LoHa, LoKr, DoRA) are errors that name a few of the keys.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError, ModelFileError
from ..models.quant import is_stored_quant
from .checkpoint import first_keys, load_checkpoint
from .file_checks import require_path
from .lora_keys import (
    FORMATS,
    KNOWN_WIDTHS,
    SKIP_REASONS,
    UNSUPPORTED,
    format_of,
    made_for,
    name_table,
    scan,
    skip_reason,
    split_key,
)

logger = logging.getLogger(__name__)

__all__ = ["LoraSpec", "LoraFile", "LoraSet", "MergedTensors", "read_lora", "prepare_loras", "parse_lora_arg",
           "describe_lora"]

@dataclass(frozen=True)
class LoraSpec:
    """One LoRA to merge: its file and strength (several add up, in order)."""

    path: str | os.PathLike
    strength: float = 1.0
    strict: bool = False  # refuse keys for parts the DiT lacks (I2V, text encoder) instead of skipping them

    def __post_init__(self) -> None:
        if isinstance(self.strength, bool) or not isinstance(self.strength, (int, float)) \
                or not math.isfinite(self.strength):
            raise ConfigError(f"The strength of the LoRA {self.path} must be a finite number, got {self.strength!r}.")


@dataclass
class _Term:
    """One addition to one parameter: ``scale · up @ down`` (a LoRA pair) or ``scale · diff`` (a full delta)."""

    scale: float
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    diff: torch.Tensor | None = None

    def compute(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        if self.diff is not None:
            return self.diff.to(device, torch.float32).reshape(shape) * self.scale
        up = self.up.to(device, torch.float32).flatten(1)
        down = self.down.to(device, torch.float32).flatten(1)
        return (up @ down).reshape(shape) * self.scale


@dataclass
class LoraFile:
    """A LoRA file read and matched to a DiT's parameters (diffusers names), ready to merge."""

    path: Path
    format: str  # a key of FORMATS
    strength: float
    terms: dict[str, list[_Term]]  # parameter name → its additions (scale includes the strength)
    ranks: Counter = field(default_factory=Counter)
    width: int | None = None  # the model width the LoRA was made for (from its attention factors)
    skipped: dict[str, list[str]] = field(default_factory=dict)  # skip reason (lora_keys.SKIP_REASONS) → keys

    @property
    def num_params_touched(self) -> int:
        return len(self.terms)


def parse_lora_arg(text: str) -> LoraSpec:
    """``FILE`` or ``FILE:STRENGTH`` (the CLI's ``--target-lora`` / ``--drafter-lora``). A Windows drive colon is no
    strength: only a number after the last colon is."""
    path, sep, tail = str(text).rpartition(":")
    if sep and path:
        try:
            strength = float(tail)
        except ValueError:
            if not Path(text).exists() and not any(c in tail for c in "/\\"):  # no drive colon, no such file
                raise ConfigError(f"LoRA {text!r}: the strength after ':' must be a number, got {tail!r} (FILE or "
                                  f"FILE:STRENGTH, e.g. {path}:0.8).") from None
            path, strength = text, 1.0
        else:
            if not math.isfinite(strength):
                raise ConfigError(f"LoRA {text!r}: the strength after ':' must be a finite number, got {tail!r}.")
    else:
        path, strength = text, 1.0
    require_path(Path(path), f"LoRA file not found: {path}. Put it in models/loras/ or fix the path (FILE or "
                             "FILE:STRENGTH).")
    return LoraSpec(path, strength)


# ----------------------------------------------------------------------------------------------------------
# reading and matching


def _metadata_alpha(metadata: Mapping[str, str]):
    """PEFT's scaling from diffusers' ``lora_adapter_metadata`` (a LoraConfig): → ``alpha(module, rank)`` giving the
    alpha for which ``alpha / rank`` is PEFT's scale (``lora_alpha`` or its ``alpha_pattern`` match, over the
    module's own rank; over √rank with ``use_rslora``), or None when the file says nothing."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        meta = json.loads(raw)
        base = float(meta["lora_alpha"])
        patterns = {str(k): float(v) for k, v in (meta.get("alpha_pattern") or {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    rslora = bool(meta.get("use_rslora"))

    def alpha(module: str, rank: int) -> float:
        value = next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", module)), base)
        return value * math.sqrt(rank) if rslora else value

    return alpha


def read_lora(spec: LoraSpec, param_shapes: Mapping[str, Sequence[int]], *, what: str = "the DiT") -> LoraFile:
    """Read ``spec``'s file and match every key to a parameter of a DiT whose diffusers-named shapes are
    ``param_shapes``. Unknown keys, incomplete pairs, unsupported variants and shape mismatches are errors."""
    path = Path(spec.path)
    require_path(path, f"LoRA file not found: {path}. Put it in models/loras/ or fix the path.")
    ck = load_checkpoint(path)
    tensors = ck.tensors
    if not tensors:
        raise ModelFileError(f"{path}: the LoRA file holds no tensors.")
    unsupported = [k for k in tensors if UNSUPPORTED.search(k)]
    if unsupported:
        raise ModelFileError(
            f"{path}: a LoRA variant SDVG does not merge (LyCORIS LoCon/LoHa/LoKr or DoRA keys: "
            f"{first_keys(unsupported, 3, count=True)}). Use a plain LoRA (lora_down/lora_up or lora_A/lora_B) or full diffs."
        )
    groups, prefixes, skipped = _match(path, tensors, param_shapes, what, strict=spec.strict)
    meta_alpha = _metadata_alpha(ck.metadata)
    out = LoraFile(path, format_of(prefixes, groups), float(spec.strength), {}, width=_width(groups), skipped=skipped)
    for module, parts in groups.items():
        _add_terms(out, module, parts, param_shapes, meta_alpha, what)
    return out


def _match(path: Path, tensors: Mapping[str, torch.Tensor], param_shapes: Mapping[str, Sequence[int]], what: str, *,
           strict: bool) -> tuple[dict[str, dict[str, torch.Tensor]], Counter, dict[str, list[str]]]:
    """Every key to its DiT parameter → (parameter → parts, prefix counts, skipped keys by reason). Keys for parts a
    T2V DiT lacks (I2V layers, a text encoder) are skipped with a warning naming them (strict: refused); any other
    key that matches nothing is an error, and so is a file of which nothing applies."""
    table = name_table(param_shapes)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown, skipped, prefixes = [], {}, Counter()
    for key, tensor in tensors.items():
        reason = skip_reason(key)
        split = split_key(key)
        module = table.get(split[1]) if split and not reason else None
        if module is None:
            (skipped.setdefault(reason, []) if reason else unknown).append(key)
            continue
        prefixes[split[0]] += 1
        if split[2] in groups.setdefault(module, {}):
            raise ModelFileError(f"{path}: two keys give the {split[2]} of {module} (e.g. {key}); the file mixes "
                                 "layouts.")
        groups[module][split[2]] = tensor
    skip_text = "; ".join(f"{len(keys)} {SKIP_REASONS[r]} (e.g. {first_keys(keys, 2)})" for r, keys in skipped.items())
    if unknown:
        raise ModelFileError(
            f"{path}: {len(unknown)} of {len(tensors)} LoRA keys match nothing in {what} (e.g. "
            f"{first_keys(unknown, 4, count=True)}); the LoRA looks made for a DiT of {made_for(scan(tensors))}"
            f"{'; besides, ' + skip_text if skip_text else ''}. SDVG merges Wan 2.1 T2V LoRAs in the layouts of "
            f"{', '.join(FORMATS)}; a LoRA for another model family or a DiT with fewer layers does not fit."
        )
    if skipped and (strict or not groups):
        why = "strict LoRA matching refuses them" if groups else "nothing else in it applies to a T2V DiT"
        fix = ", or match LoRAs without strict to skip them" if groups else ""
        raise ModelFileError(f"{path}: {skip_text}: {why}. Use a Wan 2.1 text-to-video LoRA{fix}.")
    if skipped:
        logger.warning("LoRA %s: skipped %s; the other %d keys apply to %s", path.name, skip_text,
                       len(tensors) - sum(map(len, skipped.values())), what)
    return groups, prefixes, skipped


def _width(groups: dict[str, dict[str, torch.Tensor]]) -> int | None:
    """The model width a LoRA was made for: the input width of a self-attention q/k factor (or full diff)."""
    for module, parts in groups.items():
        if re.search(r"\.attn1\.to_[qk]$", module):
            t = parts.get("down", parts.get("diff"))
            if t is not None and t.dim() >= 2:
                return int(t.flatten(1).shape[1])
    return None


def _shape_error(lora: LoraFile, param: str, got: Sequence[int], want: Sequence[int], what: str) -> ConfigError:
    made_for = f"a DiT of width {lora.width} ({KNOWN_WIDTHS.get(lora.width, 'custom')})" if lora.width else "another DiT"
    return ConfigError(
        f"{lora.path}: the LoRA was made for {made_for}: it changes {param} to shape {list(got)}, but {what} has "
        f"{list(want)}. Use a LoRA made for this model (a 14B LoRA for the target, a 1.3B LoRA for the drafter)."
    )


def _add_terms(lora: LoraFile, module: str, parts: dict[str, torch.Tensor], shapes: Mapping[str, Sequence[int]],
               meta_alpha, what: str) -> None:
    weight = module if module in shapes else module + ".weight"
    if "up" in parts or "down" in parts:
        if "up" not in parts or "down" not in parts:
            missing = "up (lora_up/lora_B)" if "up" not in parts else "down (lora_down/lora_A)"
            raise ModelFileError(f"{lora.path}: the LoRA pair of {module} has no {missing} factor; the file is "
                                 "incomplete.")
        up, down = parts["up"], parts["down"]
        rank = int(down.shape[0])
        if up.dim() < 2 or up.shape[1] != rank or any(s != 1 for s in up.shape[2:]):
            raise ModelFileError(f"{lora.path}: {module}: the up factor {list(up.shape)} does not fit the down factor "
                                 f"{list(down.shape)} (rank {rank}).")
        want = tuple(shapes[weight])
        got = (int(up.shape[0]), *down.shape[1:])
        if math.prod(got) != math.prod(want) or got[0] != want[0]:
            raise _shape_error(lora, weight, got, want, what)
        if "alpha" in parts:
            alpha = float(parts["alpha"].float().reshape(-1)[0])
        elif meta_alpha is not None:
            alpha = meta_alpha(module, rank)
        else:
            alpha = float(rank)
        lora.ranks[rank] += 1
        lora.terms.setdefault(weight, []).append(_Term(lora.strength * alpha / rank, up=up, down=down))
    elif "alpha" in parts and "diff" not in parts and "diff_b" not in parts:
        raise ModelFileError(f"{lora.path}: {module} has an alpha but no LoRA factors; the file is incomplete.")
    for part, param in (("diff", weight), ("diff_b", module + ".bias")):
        if part not in parts:
            continue
        if param not in shapes:
            raise ModelFileError(f"{lora.path}: a {part} for {module}, which has no {param.rsplit('.', 1)[-1]} in "
                                 f"{what}.")
        if math.prod(parts[part].shape) != math.prod(shapes[param]) or parts[part].shape[0] != shapes[param][0]:
            raise _shape_error(lora, param, parts[part].shape, shapes[param], what)
        lora.terms.setdefault(param, []).append(_Term(lora.strength, diff=parts[part]))


# ----------------------------------------------------------------------------------------------------------
# merging


class LoraSet:
    """Several LoRAs matched to one DiT; ``merge(name, tensor)`` adds their deltas to one parameter."""

    def __init__(self, loras: Sequence[LoraFile]) -> None:
        self.loras = list(loras)
        self._terms: dict[str, list[_Term]] = {}
        for lora in self.loras:
            if lora.strength == 0:
                continue  # strength 0 is no LoRA, exactly (the file was still checked)
            for name, terms in lora.terms.items():
                self._terms.setdefault(name, []).extend(terms)

    def __bool__(self) -> bool:
        return bool(self._terms)

    def touches(self, name: str) -> bool:
        return name in self._terms

    def merge(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` with every delta for ``name`` added, in fp32 on the tensor's device (the tensor itself when
        nothing touches it; the input is never written)."""
        terms = self._terms.get(name)
        if not terms:
            return tensor
        out = tensor.to(torch.float32, copy=True)
        for term in terms:
            out += term.compute(out.shape, out.device)
        return out

    def summary(self) -> str:
        return ", ".join(f"{lora.path.name} ×{lora.strength:g} ({FORMATS[lora.format]}, {lora.num_params_touched} "
                         "tensors)" for lora in self.loras)


class MergedTensors(Mapping):
    """A loader's lazy ``{name: tensor}`` with the LoRA deltas added as each tensor is read (one at a time). With a
    CUDA ``device`` a touched tensor is merged there (the up @ down products are the GPU's work, not the CPU's)."""

    def __init__(self, base: Mapping[str, torch.Tensor], loras: LoraSet, device: torch.device | None = None) -> None:
        self._base, self._loras = base, loras
        self._device = device if device is not None and device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self._base)

    def __iter__(self):
        return iter(self._base)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._base[name]
        if not self._loras.touches(name):
            return tensor
        if self._device is not None:
            tensor = tensor.to(self._device)
        if is_stored_quant(tensor):  # a GGUF / scaled-fp8 weight a LoRA changes: merged in fp32, kept dense
            tensor = tensor.dequantize(torch.float32)
        return self._loras.merge(name, tensor)


def prepare_loras(loras: Sequence[LoraSpec | LoraFile], param_shapes: Mapping[str, Sequence[int]], *,
                  what: str = "the DiT") -> LoraSet:
    """Read and check every LoRA against the DiT's diffusers-named parameter shapes (before any weight is read)."""
    files = []
    for item in loras:
        if isinstance(item, LoraFile):
            files.append(item)
        elif isinstance(item, LoraSpec):
            files.append(read_lora(item, param_shapes, what=what))
        else:
            raise ConfigError(f"A LoRA must be a LoraSpec(path, strength), got {item!r}.")
    return LoraSet(files)


# ----------------------------------------------------------------------------------------------------------
# inspect


def describe_lora(path: str | os.PathLike) -> str | None:
    """What a LoRA file is (layout, ranks, the width and depth it was made for, keys a T2V DiT skips), from its keys
    and factor shapes; None when it is not a LoRA for a Wan DiT."""
    ck = load_checkpoint(path)
    info = scan(ck.tensors)
    if not (info["modules"] and info["blocks"]) and not info["skipped"].get("i2v"):
        return None
    fmt = format_of(info["prefixes"], info["modules"])
    rank_text = ", ".join(f"{r} ({n}×)" for r, n in sorted(info["ranks"].items())) or "none (full diffs only)"
    lines = [f"{path}: a Wan DiT LoRA in the {FORMATS[fmt]} layout for a DiT of {made_for(info)}",
             f"  {len(ck.tensors)} tensors on {len(info['modules'])} modules; rank {rank_text}; {info['diffs']} full "
             "diffs"]
    for reason, keys in info["skipped"].items():
        lines.append(f"  {len(keys)} {SKIP_REASONS[reason]} (e.g. {first_keys(keys, 2)}): skipped with a warning on "
                     "a T2V DiT, refused with strict LoRA matching")
    lines.append("  SDVG merges it into the DiT's weights as the DiT loads (--target-lora / --drafter-lora "
                 "FILE:STRENGTH, or SDVG Load LoRA)" if info["modules"] else
                 "  nothing in it applies to a Wan 2.1 T2V DiT")
    return "\n".join(lines)
