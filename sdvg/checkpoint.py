"""Reading model files, once for every loader (DiT, VAE, text encoder, ImageReward).

* safetensors: the header (shapes, dtypes, ``__metadata__``) is parsed from the file's own JSON header with plain
  reads, so inspecting a 28 GB file never maps it (mapping needs that much free address space and fails on small
  machines); tensors are read with ``safe_open`` only when they are wanted.
* torch pickles: always ``weights_only=True`` (no code from a model file ever runs), memory-mapped when the file is
  a zip checkpoint, read plainly when it is a legacy pickle.
* training dicts (``{"generator_ema": sd, "generator": sd, "config": {...}}``) are unwrapped; key prefixes are found
  from an anchor key and stripped.
* what a file is: its first bytes (a PNG, a saved HTML login page, a Git LFS pointer, ...) and, for checkpoints, its
  key names. Every loader words its "this is not a ..." error from the same guess (:func:`looks_like`).

Every failure is a :class:`ModelFileError` naming the file, what it looks like and the fix.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import pickle
import re
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ModelFileError

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
# entries of training checkpoints that hold the weights, most wanted first (Self-Forcing/CausVid: generator_ema)
TRAINING_DICT_KEYS = ("generator_ema", "generator", "state_dict", "model", "module", "ema", "net")
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit
_HEAD_BYTES = 512
_CORRUPT = "It is truncated or corrupt (an interrupted download?); download it again."


# ----------------------------------------------------------------------------------------------------------
# what a file is, from its first bytes


_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"\x1a\x45\xdf\xa3", "a WebM/MKV video"),
    (b"\x1f\x8b", "a gzip archive (.gz / .tar.gz)"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"Rar!", "a RAR archive"),
    (b"%PDF", "a PDF document"),
    (b"GGUF", "a GGUF file (the llama.cpp / ComfyUI-GGUF quantized format, which SDVG does not read)"),
)
_PICK = "Pick the model file itself (or download it again if this is what the download gave you)."
_LFS = b"version https://git-lfs"


def _head(path: Path, n: int = _HEAD_BYTES) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)


def _lfs_message(head: bytes) -> str:
    m = re.search(rb"^size (\d+)", head, re.MULTILINE)
    real = f" ({int(m.group(1)) / 1e9:.2f} GB)" if m else ""
    return (f"this is a Git LFS pointer ({len(head)} bytes of text starting 'version https://git-lfs...'), not the "
            f"model: the real file{real} was never downloaded (the repository was cloned without Git LFS). Run "
            "`git lfs install && git lfs pull` in that clone, or download the file directly.")


def _is_html(head: bytes) -> bool:
    start = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return start.startswith((b"<!doctype html", b"<html")) or (start.startswith(b"<") and b"<html" in start)


def _is_torch_zip(path: Path) -> bool:
    """Whether a zip holds a ``torch.save`` checkpoint; unreadable zips count as one (torch then names the damage)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return any(name.endswith("data.pkl") for name in zf.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return True


def _zip_message(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    shown = ", ".join(names[:5]) + (", …" if len(names) > 5 else "")
    files = f"{len(names)} file{'s' if len(names) != 1 else ''}"
    return (f"this is a ZIP archive ({files}: {shown or 'none'}), not a PyTorch checkpoint: unpack it and pick the "
            "model file inside.")


def sniff(path: str | Path) -> str | None:
    """What ``path`` is when its first bytes show it cannot be a checkpoint (with the fix); None when it may be one."""
    path = Path(path)
    if path.stat().st_size == 0:
        return "the file is empty (0 bytes): a failed or interrupted download. Download it again."
    head = _head(path)
    if head.startswith(_LFS):
        return _lfs_message(head)
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return f"this is {what}, not a checkpoint. {_PICK}"
    if head[4:8] == b"ftyp":
        return f"this is an MP4/MOV video, not a checkpoint. {_PICK}"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return f"this is a WebP image, not a checkpoint. {_PICK}"
    if head.startswith(b"PK\x03\x04") and not _is_torch_zip(path):
        return _zip_message(path)
    if _is_html(head):
        return ("this is an HTML web page, not a checkpoint: the download saved a page (a Hugging Face login, "
                "'access restricted' or error page) instead of the model. Download the file itself again: from "
                "Hugging Face use its download link (…/resolve/main/<file>) or `hf download`, logged in and with the "
                "licence accepted if the repository is gated.")
    return None


def _text_start(head: bytes) -> str | None:
    for cut in range(4):  # the head may end inside a multi-byte character
        try:
            text = head[: len(head) - cut].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    else:
        return None
    if not text or any(not (c.isprintable() or c in "\t\r\n") for c in text):
        return None
    return " ".join(text.split())[:60]


def format_hint(path: Path) -> str:
    """A sentence for a failed read: the file is text, or the other checkpoint format; '' when nothing is known."""
    try:
        head, size = _head(path), path.stat().st_size
    except OSError:
        return ""
    text = _text_start(head)
    if text is not None:
        return (f" It looks like a text file, not a checkpoint (it starts with {text!r}): usually an error message "
                "saved by a failed download. Download the file again.")
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    if not path.name.lower().endswith(SAFETENSORS_SUFFIXES) and 0 < n < size - 8 and head[8:9] == b"{":
        return " It is a safetensors file: rename it to .safetensors."
    if path.name.lower().endswith(SAFETENSORS_SUFFIXES) and (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        return " It is a PyTorch checkpoint (torch.save), not safetensors: rename it to .pt."
    return ""


def broken_link(path: str | Path) -> str | None:
    """'<link> is a broken symbolic link ...' (naming its target) when ``path`` or a folder above it is a symbolic
    link whose target is missing or that loops; None otherwise (including for a plain missing path)."""
    for p in (Path(path), *Path(path).parents):
        if not p.is_symlink() or p.exists():
            continue
        target = os.readlink(p)
        try:
            os.stat(p)
            loop = False
        except OSError as exc:
            loop = exc.errno == errno.ELOOP
        where = (f"it points to {target}, which leads back to itself (a loop)" if loop else
                 f"it points to {target}, which is missing (moved, deleted, renamed, or on a drive that is not mounted)")
        return (f"{p} is a broken symbolic link: {where}. Fix the link (ln -sfn <the real file> {p}) or pass the "
                "real file's path.")
    return None


def require_path(path: str | Path, not_found: str) -> None:
    """A :class:`ModelFileError` when ``path`` is missing: :func:`broken_link`'s message, else ``not_found``."""
    if not Path(path).exists():
        raise ModelFileError(broken_link(path) or not_found)


def check_not_foreign(path: Path) -> None:
    """Raise when the first bytes show that ``path`` is no checkpoint at all (an image, a web page, an LFS pointer)."""
    what = sniff(path)
    if what is not None:
        raise ModelFileError(f"{path}: {what}")


# ----------------------------------------------------------------------------------------------------------
# safetensors


@dataclass(frozen=True)
class SafetensorsHeader:
    """The index of a safetensors file, read without touching (or mapping) its tensor data."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype | None]  # None: a dtype torch has no name for here
    metadata: dict[str, str]
    data_start: int  # 8 + header length
    data_len: int  # bytes the header's offsets cover
    file_size: int

    @property
    def truncated(self) -> bool:
        return self.data_start + self.data_len > self.file_size

    def require_complete(self) -> None:
        if self.truncated:
            raise ModelFileError(
                f"{self.path}: the tensors need {self.data_start + self.data_len} bytes but the file has only "
                f"{self.file_size}. {_CORRUPT}"
            )


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """Shapes, dtypes and ``__metadata__`` of a safetensors file from its JSON header (plain reads, no mmap)."""
    path = Path(path)
    check_not_foreign(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            if size < 8:
                raise ValueError(f"only {size} bytes")
            n = int.from_bytes(fh.read(8), "little")
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise ValueError(f"the header claims {n} bytes but the file has {size}")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise ValueError("__metadata__ is not a JSON object")
        shapes = {k: tuple(int(s) for s in v["shape"]) for k, v in header.items()}
        dtypes = {k: SAFETENSORS_DTYPES.get(v["dtype"]) for k, v in header.items()}
        data_len = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not a readable safetensors file ({exc}).{format_hint(path) or ' ' + _CORRUPT}") from exc
    return SafetensorsHeader(path, shapes, dtypes, {str(k): str(v) for k, v in meta.items()}, 8 + n, data_len, size)


def read_safetensors(
    path: str | Path, keys: Iterable[str] | None = None, *, device: str | torch.device = "cpu",
    header: SafetensorsHeader | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` (all when None) of a safetensors file, read straight onto ``device``."""
    from safetensors import safe_open

    path = Path(path)
    header = header or read_safetensors_header(path)
    header.require_complete()
    wanted = list(header.shapes) if keys is None else list(keys)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {k: f.get_tensor(k) for k in wanted}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ModelFileError(f"{path}: could not read the tensors ({exc}). {_CORRUPT}") from exc


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


def unwrap_state_dict(obj: Any, path: Path) -> Checkpoint:
    """The weights of a loaded pickle: a plain state dict, or the first :data:`TRAINING_DICT_KEYS` entry holding
    tensors (``generator_ema`` before ``generator``), plus the optional ``config`` dict beside them."""
    if not isinstance(obj, dict):
        raise ModelFileError(f"{path}: the checkpoint holds a {type(obj).__name__}, not a dict of tensors.")
    config = dict(obj["config"]) if isinstance(obj.get("config"), dict) else {}
    inner, entry = obj, None
    for name in TRAINING_DICT_KEYS:
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


def describe_keys(keys: Iterable[str], n: int = 5) -> str:
    """'12 tensors (first keys: a, b, …; top prefixes: x.y.* (8), …)', for error messages."""
    keys = sorted(keys)
    first = ", ".join(keys[:n]) + (", …" if len(keys) > n else "")
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
