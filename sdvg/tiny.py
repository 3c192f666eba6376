"""Tiny random-weight models in the real file formats, laid out as a ComfyUI models tree.

Tests, the demo and the tiny CPU workflow all use exactly these files, so the real loading code runs on them.
Random weights make noise videos: real weights are needed for real videos.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_VERSION = "2"
STAMP = "sdvg_tiny.json"
# The demo size for the tiny preset: 64×64 pixels → 8×8 latents.
TINY_WIDTH = 64
TINY_HEIGHT = 64


def make_tiny(models_dir: str | Path) -> dict[str, Path]:
    """Write the tiny drafter, target, VAE, text encoder and ImageReward into ``models_dir``."""
    from .reward import write_tiny_image_reward
    from .text_encoder import write_tiny_text_encoder
    from .vae import write_tiny_vae
    from .wan_loading import write_tiny_dits

    root = Path(models_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    paths.update({k: Path(v) for k, v in write_tiny_dits(root).items()})
    paths.update({k: Path(v) for k, v in write_tiny_text_encoder(root).items()})
    paths["vae"] = Path(write_tiny_vae(root))
    paths["reward"] = Path(write_tiny_image_reward(root))
    (root / STAMP).write_text(
        json.dumps({"version": TINY_VERSION, "files": {k: str(v.relative_to(root)) for k, v in paths.items()}}, indent=2),
        encoding="utf-8",
    )
    return paths


def default_tiny_dir() -> Path:
    base = os.environ.get("SDVG_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sdvg")
    return Path(base) / f"tiny-v{TINY_VERSION}"


def ensure_tiny(models_dir: str | Path | None = None) -> tuple[Path, bool]:
    """Return the tiny models tree, writing it first if it is missing. The bool says whether it was created."""
    root = Path(models_dir) if models_dir is not None else default_tiny_dir()
    stamp = root / STAMP
    if stamp.is_file():
        try:
            info = json.loads(stamp.read_text(encoding="utf-8"))
            if info.get("version") == TINY_VERSION and all((root / f).exists() for f in info["files"].values()):
                return root, False
        except (ValueError, KeyError):
            pass
    logger.info("writing the tiny preset models into %s", root)
    make_tiny(root)
    return root, True


def is_tiny_tree(models_dir: str | Path) -> bool:
    """Whether ``models_dir`` was written by :func:`make_tiny`."""
    return (Path(models_dir) / STAMP).is_file()
