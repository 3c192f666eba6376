"""Model files that fault on purpose, for the fault tests (stub host, real hosts, the browser)."""

from __future__ import annotations

from pathlib import Path

NAN_TARGET = "sdvg_nan_target.safetensors"


def write_nan_target(models_dir: str | Path) -> Path:
    """A valid tiny target DiT whose output head is NaN: every block it makes is a fault ("The target produced
    NaN/inf latents in block b")."""
    from safetensors.torch import save_file

    from sdvg.fixtures.tiny import TINY_TARGET_CONFIG, random_original_state_dict
    from sdvg.loaders.wan_keys import META_NUM_HEADS

    broken = random_original_state_dict(TINY_TARGET_CONFIG, seed=4321)
    broken["head.head.bias"] = broken["head.head.bias"] * float("nan")
    path = Path(models_dir) / "diffusion_models" / NAN_TARGET
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"model." + k: v for k, v in broken.items()}, str(path),
              metadata={META_NUM_HEADS: str(TINY_TARGET_CONFIG["num_attention_heads"])})
    return path
