"""Device and dtype parsing. Device strings come from the user; there is never a silent CPU fallback."""

from __future__ import annotations

import os

import torch

from .errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
FP8_STORAGE = "fp8_e4m3fn"
DIT_DTYPES = ("auto", "bf16", "fp16", "fp32", FP8_STORAGE)  # the DiT weight choices (CLI --dtype, loader node)
AUX_DTYPES = ("auto", "bf16", "fp16", "fp32")  # text encoder, VAE, reward
DEVICE_TYPES = ("cpu", "cuda", "mps")  # where SDVG runs; everything else torch knows (meta, xla, ...) is refused
DEVICE_CHOICES = "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
THREADS_PER_CORE = 4  # --threads above cores × this is refused (libgomp crashes on huge thread counts)


def resolve_device(spec: str | torch.device | None, *, what: str = "model") -> torch.device:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N``/``mps`` into a ``torch.device``, checking it exists.

    ``auto`` picks ``cuda:0`` when CUDA is available, else ``mps`` when available, else ``cpu``. An explicit
    CUDA device that does not exist is an error, never a fallback to CPU.
    """
    if isinstance(spec, torch.device):
        dev = spec
    else:
        if spec is not None and not isinstance(spec, str):
            raise ConfigError(f"The device for the {what} must be a string such as 'cuda:0' or a torch.device, got "
                              f"{spec!r}. Use {DEVICE_CHOICES}.")
        text = (spec or "auto").strip().lower()
        if text == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", 0)
            if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
                return torch.device("mps")
            return torch.device("cpu")
        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"Unknown device {spec!r} for the {what}. Use {DEVICE_CHOICES}.") from exc
    _check_device_type(dev, spec, what)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"The device {dev} for the {what} does not exist: this PyTorch has no CUDA device. "
                "Choose 'cpu' or 'auto', or install a CUDA build of PyTorch."
            )
        index = 0 if dev.index is None else dev.index
        count = torch.cuda.device_count()
        if index >= count:
            raise ConfigError(
                f"The device cuda:{index} for the {what} does not exist: only {count} CUDA device(s) exist "
                f"(cuda:0..cuda:{count - 1}). Pick an existing device."
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"The device mps for the {what} is not available here. Choose 'cpu' or 'auto'.")
    return dev


def _check_device_type(dev: torch.device, spec, what: str) -> None:
    """Only cpu/cuda/mps: 'meta' (shapes, no values) and other back ends (xla, hpu, ...) fail far downstream."""
    if dev.type == "meta":
        raise ConfigError(
            f"The device {str(spec)!r} for the {what} is PyTorch's 'meta' device, which holds shapes but no values, "
            f"so nothing can run on it. Use {DEVICE_CHOICES}."
        )
    if dev.type not in DEVICE_TYPES:
        raise ConfigError(
            f"The device {str(spec)!r} for the {what} is of type {dev.type!r}, which SDVG does not run on. Use "
            f"{DEVICE_CHOICES}."
        )


def max_cpu_threads() -> int:
    """The most ``--threads`` accepted: the machine's cores × :data:`THREADS_PER_CORE`."""
    return (os.cpu_count() or 1) * THREADS_PER_CORE


def parse_dtype(name: str | torch.dtype | None, *, default: torch.dtype) -> torch.dtype | str:
    """``auto``/``bf16``/``fp16``/``fp32`` → torch dtype; ``fp8_e4m3fn`` is returned as the string marker
    for fp8 *storage* with bf16 compute (handled by the loader)."""
    if isinstance(name, torch.dtype):
        return name
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"The weight dtype must be a name such as 'bf16' or a torch.dtype, got {name!r}.")
    text = (name or "auto").strip().lower()
    if text == "auto":
        return default
    if text == FP8_STORAGE:
        return FP8_STORAGE
    if text not in DTYPES:
        raise ConfigError(f"Unknown weight dtype {name!r}. Use one of: auto, bf16, fp16, fp32, {FP8_STORAGE}.")
    return DTYPES[text]


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (the reference dtype of both DiTs), fp32 on CPU/MPS where bf16 matmuls are slow or absent."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def set_cpu_threads(n: int | None, default: int | None = None) -> int:
    """Set torch's intra-op CPU threads to ``n`` (or ``default`` when ``n`` is None; both None: torch's choice) and
    return the number in force. ``n`` < 1 or above :func:`max_cpu_threads` is a ConfigError that names the option."""
    n = n if n is not None else default
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"--threads must be a whole number ≥ 1, got {n!r}.")
        limit = max_cpu_threads()
        if n > limit:
            raise ConfigError(
                f"--threads {n} is more than this machine can use: it has {os.cpu_count() or 1} CPU core(s), and at "
                f"most {limit} threads ({THREADS_PER_CORE} per core) are accepted. Use a number from 1 to {limit}, "
                "or leave --threads out for PyTorch's choice."
            )
        torch.set_num_threads(n)
    return torch.get_num_threads()

