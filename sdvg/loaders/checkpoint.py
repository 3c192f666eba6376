"""Reading model files, once for every loader (DiT, VAE, text encoder, ImageReward).

* safetensors (``safetensors_io.py``): the header is parsed from the file's own JSON header and tensors are read one
  at a time with plain reads, so a 28 GB file is never mapped nor held whole in RAM.
* torch pickles: always ``weights_only=True`` (no code from a model file ever runs), memory-mapped when the file is
  a zip checkpoint, read plainly when it is a legacy pickle.
* training dicts (``{"generator_ema": sd, "generator": sd, "config": {...}}``) are unwrapped; key prefixes are found
  from an anchor key and stripped.
* what a file is: its first bytes (``file_checks.py``: a PNG, a saved HTML login page, a Git LFS pointer, ...) and,
  for checkpoints, its key names. Every loader words its "this is not a ..." error from the same guess (:func:`looks_like`).

Every failure is a :class:`ModelFileError` naming the file, what it looks like and the fix.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import pickle
import re
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, ModelFileError
from .file_checks import SAFETENSORS_SUFFIXES, check_not_foreign, format_hint
from .safetensors_io import read_safetensors, read_safetensors_header

logger = logging.getLogger(__name__)

# entries of training checkpoints that hold the weights, most wanted first (Self-Forcing/CausVid: generator_ema)
TRAINING_DICT_KEYS = ("generator_ema", "generator", "state_dict", "model", "module", "ema", "net")


# ----------------------------------------------------------------------------------------------------------
# torch pickles


# torch's advice on refusing a pickle (weights_only=False, allowlist the globals) runs a malicious file's payload
_UNSAFE_ADVICE = re.compile(r"weights_only`?\s*(set to|=)\s*`?false|safe_globals|allowlist|trust|arbitrary code"
                            r"|two options|documentation of torch\.load|file an issue", re.IGNORECASE)


def safe_detail(text: str) -> str:
    """torch's reason for refusing a file, without its sentences advising to load it unsafely."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # terminal colour codes
    sentences = re.split(r"(?<=[.!?:])\s+|\n+", text)
    kept = [s.strip() for s in sentences if s.strip() and not _UNSAFE_ADVICE.search(s)]
    return " ".join(kept)


def _unpickling_detail(exc: Exception) -> str:
    lines = [d for d in map(safe_detail, str(exc).splitlines()) if d and d.rstrip(":") != "WeightsUnpickler error"]
    detail = next((ln for ln in lines if "Unsupported" in ln), lines[0] if lines else type(exc).__name__)
    return detail[:300].rstrip(". ")


def torch_load(path: str | Path) -> Any:
    """``torch.load`` with ``weights_only=True`` (never runs code from the file), memory-mapped when possible."""
    path = Path(path)
    check_not_foreign(path)
    try:
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(str(path), map_location="cpu", weights_only=True)  # a legacy (non-zip) pickle
    except pickle.UnpicklingError as exc:
        raise _refusal(path, _unpickling_detail(exc)) from None  # torch's own text advises weights_only=False
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        hint = format_hint(path) or (" The file is truncated or corrupt (an interrupted download?) or not a torch "
                                     "checkpoint; download it again.")
        raise ModelFileError(
            f"{path}: could not read the torch checkpoint with torch.load(weights_only=True) ({type(exc).__name__}: "
            f"{safe_detail(str(exc))[:300]}).{hint}"
        ) from exc


def _refusal(path: Path, detail: str) -> ModelFileError:
    """The error for a pickle the safe loader rejected: never torch's advice to load it unsafely."""
    hint = format_hint(path)
    if hint:  # text, or a safetensors file under a pickle name
        return ModelFileError(f"{path}: not a PyTorch checkpoint, so torch.load(weights_only=True) cannot read it "
                              f"({detail}).{hint}")
    held = ("code or objects that are not plain tensors" if "global" in detail.lower() or "class" in detail.lower() else
            "code, objects or pickle instructions a plain tensor file does not need (or it is not a torch checkpoint)")
    return ModelFileError(
        f"{path}: refused to load. The pickle holds {held}, so the safe loader (torch.load weights_only=True) "
        f"rejected it ({detail}). SDVG never runs code from model files, and loading this one any other way could "
        "run whatever it holds: use a .safetensors version of this checkpoint (or a plain tensor state dict) "
        "from a source you trust."
    )


# ----------------------------------------------------------------------------------------------------------
# checkpoints: tensors + where they came from


@dataclass
class Checkpoint:
    """The tensors of one file and what surrounded them."""

    path: Path
    format: str  # "safetensors" | "pt"
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    entry: str | None = None  # the training-dict entry that held the weights ("generator_ema", ...)
    config: dict[str, Any] = field(default_factory=dict)  # a pickle's "config" entry
    others: list[str] = field(default_factory=list)  # top-level entries that are neither weights nor config


def unwrap_state_dict(obj: Any, path: Path, *, pt_weights: str = "ema") -> Checkpoint:
    """The weights of a loaded pickle: a plain state dict, or the first :data:`TRAINING_DICT_KEYS` entry holding
    tensors (``generator_ema`` before ``generator``; ``pt_weights="generator"``: the other way round, as the SDVG
    authors' loader), plus the optional ``config`` dict beside them."""
    if not isinstance(obj, dict):
        raise ModelFileError(f"{path}: the checkpoint holds a {type(obj).__name__}, not a dict of tensors.")
    config = dict(obj["config"]) if isinstance(obj.get("config"), dict) else {}
    inner, entry = obj, None
    if pt_weights not in ("ema", "generator"):
        raise ConfigError(f"pt_weights must be 'ema' or 'generator', got {pt_weights!r}.")
    order = TRAINING_DICT_KEYS if pt_weights == "ema" else ("generator", *(k for k in TRAINING_DICT_KEYS if k != "generator"))
    for name in order:
        cand = obj.get(name)
        if isinstance(cand, dict) and any(torch.is_tensor(v) for v in cand.values()):
            inner, entry = cand, name
            break
    tensors = {k: v for k, v in inner.items() if isinstance(k, str) and torch.is_tensor(v)}
    if not tensors:
        raise ModelFileError(
            f"{path}: no tensors found (top-level entries: {', '.join(map(str, list(obj)[:8]))}). Expected a state "
            "dict or a dict with 'generator_ema' / 'generator' / 'state_dict'."
        )
    others = [str(k) for k, v in obj.items() if k not in (entry, "config") and not torch.is_tensor(v)]
    return Checkpoint(path, "pt", tensors, entry=entry, config=config, others=others)


def is_safetensors_name(path: Path) -> bool:
    return path.name.lower().endswith(SAFETENSORS_SUFFIXES)


def load_checkpoint(path: str | Path, *, device: str | torch.device = "cpu") -> Checkpoint:
    """Every tensor of a ``.safetensors``/``.sft`` file or a torch pickle (unwrapped), by the file name."""
    path = Path(path)
    if is_safetensors_name(path):
        header = read_safetensors_header(path)
        return Checkpoint(path, "safetensors", read_safetensors(path, header=header, device=device), header.metadata)
    return unwrap_state_dict(torch_load(path), path)


# ----------------------------------------------------------------------------------------------------------
# key prefixes


def prefix_before(keys: Iterable[str], anchor: str) -> str | None:
    """The shortest prefix ``p`` ('' or ending in '.') such that ``p + anchor`` is a key; None when there is none."""
    hits = [k[: -len(anchor)] for k in keys if k.endswith(anchor)]
    hits = [p for p in hits if not p or p.endswith(".")]
    return min(hits, key=len) if hits else None


def common_prefix(keys: Iterable[str], prefixes: Iterable[str]) -> str:
    """The first of ``prefixes`` that every key starts with ('' when none does)."""
    keys = list(keys)
    return next((p for p in prefixes if keys and all(k.startswith(p) for k in keys)), "")


def strip_prefix(sd: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The entries under ``prefix`` with the prefix removed (other entries are dropped)."""
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


# ----------------------------------------------------------------------------------------------------------
# what a checkpoint is, from its keys


@dataclass(frozen=True)
class Kind:
    """One kind of model file: how its keys look, what to call it and which ComfyUI models/ folder it goes in."""

    label: str
    folder: str
    pattern: str


# Checked in order: the more specific or dominant kind first (a VACE model is also a Wan DiT; an all-in-one SD
# checkpoint also holds a VAE and a CLIP).
KINDS = (
    Kind("a LoRA (an add-on for a model, not a full model)", "loras", r"lora_(up|down|A|B)\b|\.lora\.|\.alpha$"),
    Kind("a Wan VACE model", "diffusion_models", r"vace_blocks\.|vace_patch_embedding"),
    Kind("a different diffusion model (Flux/SD3/SD UNet)", "diffusion_models",
         r"double_blocks\.|single_blocks\.|joint_blocks\.|input_blocks\.\d+"),
    Kind("a Wan DiT (diffusion model)", "diffusion_models",
         r"head\.modulation|patch_embedding\.weight|blocks\.\d+\.(self_attn|cross_attn)\.|blocks\.\d+\.attn1\.to_q"
         r"|condition_embedder\."),
    Kind("an ImageReward/BLIP checkpoint", "image_reward", r"^blip\.|^mlp\.layers\.|visual_encoder\.blocks\."),
    Kind("a CLIP model", "clip_vision", r"^visual\.|vision_model\.|^textual\.|text_model\.encoder\."),
    Kind("a UMT5/T5 text encoder", "text_encoders", r"spiece_model|encoder\.block\.\d+\.layer|^shared\.weight|token_embd"),
    Kind("the Wan UMT5 text encoder (.pth)", "text_encoders",
         r"token_embedding\.weight|(^|\.)blocks\.\d+\.attn\.q\.|blocks\.\d+\.pos_embedding"),
    Kind("a Wan VAE", "vae",
         r"decoder\.middle\.0\.residual|decoder\.upsamples\.\d|(decoder|encoder)\.(mid_block|up_blocks|down_blocks)\..*gamma$"),
    Kind("an image (SD/Flux-style) VAE, not the Wan 2.1 video VAE", "vae",
         r"(^|\.)(encoder\.down\.\d|decoder\.up\.\d|encoder\.down_blocks\.|decoder\.up_blocks\.)"),
)
_DIT_TRAINING = Kind("a Self-Forcing/CausVid DiT training checkpoint (generator/generator_ema)", "diffusion_models", "")


def identify(keys: Iterable[str], *, entry: str | None = None) -> Kind | None:
    """The kind of model a set of tensor names belongs to, or None."""
    if entry in ("generator", "generator_ema"):
        return _DIT_TRAINING
    joined = "\n".join(sorted(keys)[:5000])
    return next((k for k in KINDS if re.search(k.pattern, joined, re.MULTILINE)), None)


def looks_like(keys: Iterable[str], *, entry: str | None = None) -> str:
    """'a Wan VAE, which goes in models/vae/' or 'an unknown model', for error messages."""
    kind = identify(keys, entry=entry)
    return f"{kind.label}, which goes in models/{kind.folder}/" if kind else "an unknown model"


def first_keys(keys: Iterable[str], n: int = 5, *, count: bool = False) -> str:
    """The first ``n`` keys in sorted order, for error messages: 'a, b, …' (``count``: 'a, b, … (12 in all)')."""
    keys = sorted(keys)
    more = (f", … ({len(keys)} in all)" if count else ", …") if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def describe_keys(keys: Iterable[str], n: int = 5) -> str:
    """'12 tensors (first keys: a, b, …; top prefixes: x.y.* (8), …)', for error messages."""
    keys = sorted(keys)
    first = first_keys(keys, n)
    top = collections.Counter(".".join(k.split(".")[:2]) for k in keys).most_common(n)
    prefixes = ", ".join(f"{p}.* ({c})" for p, c in top)
    return f"{len(keys)} tensor{'s' if len(keys) != 1 else ''} (first keys: {first or 'none'}; top prefixes: " \
           f"{prefixes or 'none'})"


def describe_checkpoint(ck: Checkpoint) -> str:
    """What a checkpoint holds: its tensors and, for training dicts, the entry they came from and the others."""
    where = f" under {ck.entry!r}" if ck.entry else ""
    beside = f", beside the non-tensor entries {', '.join(ck.others[:6])}" if ck.others else ""
    return f"{describe_keys(ck.tensors)}{where}{beside}"


# ----------------------------------------------------------------------------------------------------------
# building models without memory


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create module parameters on the meta device (no memory, no init cost) so a state dict can be assigned; buffers
    computed in ``__init__`` (e.g. RoPE tables) stay real because they are not in the state dict."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            cls = type(module._parameters[name])
            module._parameters[name] = cls(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
