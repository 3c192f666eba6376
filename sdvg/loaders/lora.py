"""Wan 2.1 LoRAs merged into a DiT while it loads: each weight gets its delta on its way to the device, in fp32 and
before any fp8 conversion, so no second copy of the model is ever held.

Accepted files (``.safetensors``, or torch pickles read with ``weights_only=True``), with the key layouts users have:

* ComfyUI / kohya: ``lora_unet_blocks_0_self_attn_q.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``;
* diffusers / PEFT: ``transformer.blocks.0.attn1.to_q.lora_A.weight`` / ``.lora_B.weight`` (alpha from an
  ``.alpha`` tensor, or from the ``lora_adapter_metadata`` diffusers writes; else alpha = rank);
* original Wan keys: ``diffusion_model.blocks.0.self_attn.q.lora_A.weight`` (or ``lora_down``/``lora_up``) and
  ``.alpha``;
* full deltas in any of these layouts: ``….diff`` (added to the weight) and ``….diff_b`` / ``lora_B.bias`` (added to
  the bias), as in CausVid / lightx2v distillation LoRAs.

Module names are matched through the same original ↔ diffusers name map the DiT loader uses
(:func:`wan_keys.diffusers_to_original_key`, the inverse of diffusers' own converter), on names only. We do not use
diffusers' ``_convert_non_diffusers_wan_lora_to_diffusers``: it rescales the factors by alpha in their stored dtype
and silently drops some keys (norm diffs), where a merge at load time wants the factors as stored and every key
accounted for.

The merge of one weight ``W`` is ``W.float() + Σ_i strength_i · (alpha_i / rank_i) · (up_i.float() @ down_i.float())``
(plus ``strength_i · diff_i`` for full deltas), then the loader converts it to the model's dtype. A key that maps to
nothing in the DiT, a LoRA for another width, and LoRA variants we do not merge (LoCon mid, LoHa, LoKr, DoRA) are
errors that name a few of the keys.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, ModelFileError
from .checkpoint import first_keys, load_checkpoint
from .file_checks import require_path
from .wan_keys import diffusers_to_original_key

__all__ = ["LoraSpec", "LoraFile", "LoraSet", "MergedTensors", "read_lora", "prepare_loras", "parse_lora_arg",
           "describe_lora"]

# key prefixes, longest first (the kohya one has no dot: module names follow with "_" for ".")
PREFIXES = ("base_model.model.diffusion_model.", "model.diffusion_model.", "base_model.model.", "diffusion_model.",
            "transformer.", "lora_transformer_", "lora_unet_", "")
# key suffix → the part it is
SUFFIXES = (
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora_B.bias", "diff_b"),
    (".alpha", "alpha"), (".diff_b", "diff_b"), (".diff", "diff"),
)
UNSUPPORTED = re.compile(r"lora_mid|hada_|lokr_|dora_scale|\.w[12]_[ab]|magnitude_vector")
FORMATS = {
    "kohya": "ComfyUI/kohya (lora_unet_…, lora_down/lora_up/alpha)",
    "diffusers": "diffusers/PEFT (transformer.…, lora_A/lora_B)",
    "original": "original Wan keys (diffusion_model.…)",
}
KNOWN_WIDTHS = {1536: "Wan 2.1 1.3B", 5120: "Wan 2.1 14B"}


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA to merge: its file and strength (several add up, in order)."""

    path: str | os.PathLike
    strength: float = 1.0

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
# names


def _split_key(key: str) -> tuple[str, str, str] | None:
    """→ (prefix, module, part) or None when the key is no LoRA key we know."""
    found = next(((key[: -len(suffix)], part) for suffix, part in SUFFIXES if key.endswith(suffix)), None)
    if found is None:
        return None
    stem, part = found
    for prefix in PREFIXES:
        if stem.startswith(prefix):
            return prefix, stem[len(prefix):], part
    return None  # pragma: no cover - "" always matches


def _name_table(param_shapes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Every spelling of a module or parameter (diffusers, original, both with '_' for '.') → diffusers name
    (a module's ``.weight`` dropped; a bare parameter such as ``scale_shift_table`` kept whole)."""
    table: dict[str, str] = {}
    for key in param_shapes:
        name = key[: -len(".weight")] if key.endswith(".weight") else key
        if key.endswith(".bias"):
            continue
        original = diffusers_to_original_key(key)
        original = original[: -len(".weight")] if original.endswith(".weight") else original
        for spelling in (name, original):
            table.setdefault(spelling, name)
            table.setdefault(spelling.replace(".", "_"), name)
    return table


def _format_of(prefixes: Counter, modules: Iterable[str]) -> str:
    prefix = prefixes.most_common(1)[0][0] if prefixes else ""
    if prefix.startswith("lora_"):
        return "kohya"
    if prefix in ("transformer.", "base_model.model.") or any(".attn1." in m or m.startswith("blocks.") and ".to_q" in m
                                                            for m in modules):
        return "diffusers"
    return "original"


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
    table = _name_table(param_shapes)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    prefixes: Counter = Counter()
    for key, tensor in tensors.items():
        split = _split_key(key)
        module = table.get(split[1]) if split else None
        if module is None:
            unknown.append(key)
            continue
        prefixes[split[0]] += 1
        part = split[2]
        if part in groups.setdefault(module, {}):
            raise ModelFileError(f"{path}: two keys give the {part} of {module} (e.g. {key}); the file mixes layouts.")
        groups[module][part] = tensor
    if unknown:
        raise ModelFileError(
            f"{path}: {len(unknown)} of {len(tensors)} LoRA keys match nothing in {what} (e.g. {first_keys(unknown, 4, count=True)}); "
            f"the LoRA looks made for a DiT of {_made_for(_scan(tensors))}. "
            "SDVG merges Wan 2.1 T2V LoRAs in the kohya (lora_unet_…), diffusers (transformer.…) or original "
            "(diffusion_model.…) layouts; a LoRA for an I2V model, another model family, or a DiT with fewer layers "
            "does not fit."
        )
    meta_alpha = _metadata_alpha(ck.metadata)
    out = LoraFile(path, _format_of(prefixes, groups), float(spec.strength), {}, width=_width(groups))
    for module, parts in groups.items():
        _add_terms(out, module, parts, param_shapes, meta_alpha, what)
    return out


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
        if self._device is not None and self._loras.touches(name):
            tensor = tensor.to(self._device)
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


def _scan(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What a LoRA's keys and factor shapes say, without matching them to a model."""
    prefixes: Counter = Counter()
    modules: set[str] = set()
    ranks: Counter = Counter()
    width, blocks, diffs = None, set(), 0
    for key, tensor in tensors.items():
        split = _split_key(key)
        if split is None:
            continue
        prefix, module, part = split
        prefixes[prefix] += 1
        modules.add(module)
        if m := re.match(r"blocks[._](\d+)[._]", module):
            blocks.add(int(m.group(1)))
        if part == "down":
            ranks[int(tensor.shape[0])] += 1
        diffs += part in ("diff", "diff_b")
        if width is None and part in ("down", "diff") and re.search(r"(self_attn|attn1)[._](to_)?[qk]$", module):
            width = int(tensor.flatten(1).shape[1])
    return {"prefixes": prefixes, "modules": modules, "ranks": ranks, "width": width,
            "blocks": max(blocks) + 1 if blocks else 0, "diffs": diffs}


def _made_for(scan: dict[str, Any]) -> str:
    width = scan["width"]
    text = f"width {width} ({KNOWN_WIDTHS.get(width, 'custom')})" if width else "unknown width"
    return text + (f", {scan['blocks']} blocks" if scan["blocks"] else "")


def describe_lora(path: str | os.PathLike) -> str | None:
    """What a LoRA file is (layout, ranks, the width it was made for), from its keys and factor shapes; None when
    it is not a LoRA for a Wan DiT."""
    ck = load_checkpoint(path)
    scan = _scan(ck.tensors)
    if not scan["modules"] or not scan["blocks"]:
        return None
    fmt = _format_of(scan["prefixes"], scan["modules"])
    rank_text = ", ".join(f"{r} ({n}×)" for r, n in sorted(scan["ranks"].items())) or "none (full diffs only)"
    return (f"{path}: a Wan DiT LoRA in the {FORMATS[fmt]} layout for a DiT of {_made_for(scan)}\n"
            f"  {len(ck.tensors)} tensors on {len(scan['modules'])} modules; rank {rank_text}; {scan['diffs']} full "
            "diffs; merged at load time (--target-lora / --drafter-lora FILE:STRENGTH)")
