"""What ``generate`` checks about a run's length before a model loads: the DiTs' RoPE tables (read from the files'
headers) against the frames the cache regime positions absolutely, and the disk's free space against the files the
run will write (the mp4's size estimated, the safetensors dumps' exact)."""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import FRAMES_PER_BLOCK, LATENT_CHANNELS, ConfigError, pixel_frames_for_blocks

# H.264 at crf 18 (yuv420p): the bits per pixel the mp4 size estimate assumes for a natural 480p video. An assumption,
# not measured on real models (none here); measured at 64×64 (6 blocks, 69 frames): the toy world 0.43, the random
# tiny models' noise 2.5 — noise-like video needs far more than the estimate, so the check refuses only clear cases
MP4_BITS_PER_PIXEL = 0.3
MIB = 2**20


def check_dits_fit(source, need, config) -> None:
    """Refuse a size or a run longer than a DiT's RoPE table can position (global cache, noisy with absolute
    positions) before anything loads, from the DiT files' headers."""
    from ..loaders import inspect_dits, model_paths

    paths = model_paths(source.models_dir, need, **source.files)  # every file checked, as loading would check them
    for info in inspect_dits(paths).values():
        config.check_dit_fits(info.config)


def estimated_mp4_bytes(frames: int, width: int, height: int) -> int:
    return int(frames * width * height * MP4_BITS_PER_PIXEL / 8)


def output_bytes(plan, config) -> dict[str, int]:
    """Bytes each planned output will take: the mp4 estimated, the frame and latent dumps exact (uint8 frames,
    float32 latents), the report and timeline negligible."""
    frames = config.num_frames or pixel_frames_for_blocks(config.num_blocks)
    h, w = config.latent_hw
    sizes = {"video": estimated_mp4_bytes(frames, config.width, config.height),
             "frames": frames * config.width * config.height * 3,
             "latents": config.num_blocks * FRAMES_PER_BLOCK * LATENT_CHANNELS * h * w * 4}
    return {role: size for role, size in sizes.items() if plan[role] is not None}


def check_disk_space(plan, config, *, free=None) -> None:
    """Refuse a run whose outputs will not fit in the free space of their disk (``free(folder)`` → bytes; default
    ``shutil.disk_usage``), naming the estimate and what fits."""
    from ..outputs import OUTPUTS

    free = free or (lambda folder: shutil.disk_usage(folder).free)
    by_disk: dict[Path, list[tuple[str, int]]] = {}
    for role, size in output_bytes(plan, config).items():
        by_disk.setdefault(_existing_folder(plan[role]), []).append((role, size))
    for folder, items in by_disk.items():
        need, have = sum(size for _, size in items), free(folder)
        if need > have:
            what = ", ".join(f"{OUTPUTS[role][0]} {_size(size)}" + (" (estimated)" if role == "video" else "")
                             for role, size in items)
            per_block = need / config.num_blocks
            fits = int(have // per_block) if per_block else 0
            raise ConfigError(
                f"This run's outputs need about {_size(need)} ({what}) but {folder} has {_size(have)} free; free "
                f"some space, write elsewhere, or make fewer blocks (about {fits} fit).")


def _existing_folder(path: Path) -> Path:
    folder = Path(path).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", MIB)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"
