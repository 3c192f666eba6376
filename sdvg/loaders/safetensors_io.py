"""safetensors files with plain reads only: the header (shapes, dtypes, byte ranges, ``__metadata__``) and tensors one
at a time, never a memory map of the file.

Mapping a 28.6 GB checkpoint needs that much free address space (``ulimit -v``, overcommit limits and small machines
refuse it: "unable to mmap … Cannot allocate memory"), and reading every tensor into RAM before the model is built
needs that much RAM. Here each tensor is read with ``pread`` into its own buffer when it is asked for
(:class:`LazyTensors`), so a loader can move it to its device and drop it before reading the next: the peak is one
tensor (the 14B's largest is 141 MB).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelFileError
from .file_checks import CORRUPT_HINT, check_not_foreign, format_hint

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
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit


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
    offsets: dict[str, tuple[int, int]]  # key → (begin, end) byte range after data_start

    @property
    def truncated(self) -> bool:
        return self.data_start + self.data_len > self.file_size

    def require_complete(self) -> None:
        if self.truncated:
            raise ModelFileError(
                f"{self.path}: the tensors need {self.data_start + self.data_len} bytes but the file has only "
                f"{self.file_size}. {CORRUPT_HINT}"
            )


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """Shapes, dtypes, byte ranges and ``__metadata__`` of a safetensors file from its JSON header (plain reads)."""
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
        offsets = {k: (int(v["data_offsets"][0]), int(v["data_offsets"][1])) for k, v in header.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not a readable safetensors file ({exc}).{format_hint(path) or ' ' + CORRUPT_HINT}") from exc
    data_len = max((end for _, end in offsets.values()), default=0)
    return SafetensorsHeader(path, shapes, dtypes, {str(k): str(v) for k, v in meta.items()}, 8 + n, data_len, size,
                             offsets)


class LazyTensors(Mapping):
    """The tensors of one safetensors file as a read-only mapping; each ``[key]`` reads that tensor from the file
    (``pread`` into a fresh CPU buffer: no map, nothing kept). Iterating gives the keys only."""

    def __init__(self, header: SafetensorsHeader, keys: Iterable[str] | None = None) -> None:
        header.require_complete()
        self.header = header
        self._keys = list(header.shapes) if keys is None else list(keys)
        unknown = [k for k in self._keys if k not in header.shapes]
        if unknown:
            raise KeyError(unknown[0])

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self.header.shapes and key in self._keys

    def __getitem__(self, key: str) -> torch.Tensor:
        h = self.header
        dtype, shape = h.dtypes[key], h.shapes[key]
        if dtype is None:
            raise ModelFileError(f"{h.path}: tensor {key!r} has a dtype PyTorch cannot read here.")
        begin, end = h.offsets[key]
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != want:
            raise ModelFileError(f"{h.path}: tensor {key!r} holds {end - begin} bytes for shape {list(shape)} "
                                 f"({want} expected). {CORRUPT_HINT}")
        buffer = bytearray(want)
        got = _read_into(h.path, h.data_start + begin, buffer)
        if got != want:
            raise ModelFileError(f"{h.path}: could not read tensor {key!r} ({got} of {want} bytes). {CORRUPT_HINT}")
        if not want:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


class ReadOnAccess(Mapping):
    """Renamed tensors read one at a time when asked for, moved to ``device`` (meta: kept on the CPU)."""

    def __init__(self, names: dict[str, str], read, device: torch.device) -> None:
        self._names, self._read = names, read
        self._device = None if device.type in ("cpu", "meta") else device

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        return iter(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._read(self._names[name])
        return tensor if self._device is None else tensor.to(self._device)


def read_span(path: str | Path, offset: int, nbytes: int) -> bytearray:
    """``nbytes`` of ``path`` from ``offset`` with plain reads (never a map of the file); short at the end of a
    truncated file."""
    buffer = bytearray(nbytes)
    got = _read_into(Path(path), offset, buffer)
    return buffer if got == nbytes else buffer[:got]


def _read_into(path: Path, offset: int, buffer: bytearray) -> int:
    """Fill ``buffer`` from ``path`` at ``offset`` with plain reads (portable: Windows has no pread)."""
    view, got = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        while got < len(buffer):
            n = fh.readinto(view[got:])
            if not n:
                break
            got += n
    return got


def read_safetensors(
    path: str | Path, keys: Iterable[str] | None = None, *, device: str | torch.device = "cpu",
    header: SafetensorsHeader | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` (all when None) of a safetensors file on ``device``, read one at a time."""
    lazy = LazyTensors(header or read_safetensors_header(path), keys)
    dev = torch.device(device)
    return {k: (lazy[k] if dev.type == "cpu" else lazy[k].to(dev)) for k in lazy}
