"""Device and dtype parsing. Device strings come from the user; there is never a silent CPU fallback."""

from __future__ import annotations

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


def resolve_device(spec: str | torch.device | None, *, what: str = "model") -> torch.device:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N``/``mps`` into a ``torch.device``, checking it exists.

    ``auto`` picks ``cuda:0`` when CUDA is available, else ``mps`` when available, else ``cpu``. An explicit
    CUDA device that does not exist is an error, never a fallback to CPU.
    """
    if isinstance(spec, torch.device):
        dev = spec
    else:
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
            raise ConfigError(
                f"Unknown device {spec!r} for the {what}. Use 'auto', 'cpu', 'cuda' or 'cuda:N'."
            ) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"The {what} was placed on {dev} but this PyTorch has no CUDA device. "
                "Choose 'cpu' or 'auto', or install a CUDA build of PyTorch."
            )
        index = 0 if dev.index is None else dev.index
        count = torch.cuda.device_count()
        if index >= count:
            raise ConfigError(
                f"The {what} was placed on cuda:{index} but only {count} CUDA device(s) exist "
                f"(cuda:0..cuda:{count - 1}). Pick an existing device."
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"The {what} was placed on mps but MPS is not available. Choose 'cpu' or 'auto'.")
    return dev


def parse_dtype(name: str | torch.dtype | None, *, default: torch.dtype) -> torch.dtype | str:
    """``auto``/``bf16``/``fp16``/``fp32`` → torch dtype; ``fp8_e4m3fn`` is returned as the string marker
    for fp8 *storage* with bf16 compute (handled by the loader)."""
    if isinstance(name, torch.dtype):
        return name
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
    return the number in force. ``n`` < 1 is a ConfigError that names the option."""
    n = n if n is not None else default
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"--threads must be a whole number ≥ 1, got {n!r}.")
        torch.set_num_threads(n)
    return torch.get_num_threads()

