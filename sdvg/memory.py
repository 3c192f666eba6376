"""How much memory there is, asked before anything large is allocated or read.

``free_bytes(device)``: free VRAM on a CUDA device; on the CPU the RAM the kernel can still hand out (``MemAvailable``),
capped by the process's address-space limit (``ulimit -v``) where one is set; None where the system does not say.
``check_fits`` turns a "this will not fit" into a ConfigError that says what does not fit and what would.
"""

from __future__ import annotations

import os

import torch

try:  # POSIX only (Windows has no address-space limit to read)
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None

from .errors import ConfigError

GB = 1e9
HEADROOM = 0.95  # leave 5 % for the allocator, activations of the first call, and everything else that runs


def physical_memory_bytes() -> int | None:
    """This machine's RAM (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _address_space_left() -> int | None:
    if resource is None:
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as fh:
            used = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        used = 0
    return max(0, soft - used)


def free_bytes(device: torch.device) -> int | None:
    """Memory that a load onto ``device`` can still use (see the module docstring)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    limits = [v for v in (_meminfo("MemAvailable"), _address_space_left()) if v is not None]
    return min(limits) if limits else None


def check_fits(what: str, need: int, device: torch.device, *, options: str = "",
               available: int | None = None) -> None:
    """Raise a ConfigError before a load of ``need`` bytes onto ``device`` that cannot fit; ``options`` says what would
    (e.g. a smaller dtype). ``available`` overrides the measured free memory (tests)."""
    free = free_bytes(device) if available is None else available
    if free is None or need <= free * HEADROOM:
        return
    raise ConfigError(
        f"{what} needs about {need / GB:.1f} GB on {device}, but only {free / GB:.1f} GB are free there, so it was not "
        f"read.{' ' + options if options else ''} Or free memory, or use a device with more of it."
    )
