"""The toy world's trained models, committed with the project: the embedded default of the CLI, the demo and the CPU
workflow.

``sdvg/toy/models/`` is a ComfyUI-style models tree (``diffusion_models/``, ``text_encoders/``, ``vae/``,
``image_reward/``) written by ``python -m sdvg toy train`` with the stamp ``sdvg_toy.json`` (command, seeds, steps,
losses). The models were trained for this world only: toy captions ("a red circle moving left on a black
background", :func:`sdvg.toy.world.all_captions`) at 64×64 pixels. They are flow-matching models, not distilled
few-step ones, so they sample with :data:`TOY_SCHEDULE` (10 steps down to t = 100) instead of Self-Forcing's 4.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelFileError

TOY_DIR = Path(__file__).resolve().parent / "models"
STAMP = "sdvg_toy.json"
STAGES = ("vae", "text", "target", "target_ft", "drafter", "critic")  # `toy train`, in this order
#: the flow-matching drafter `toy train` makes (trained like the target, smaller); the tree's default drafter is the
#: one its stamp names (since issue 25 the Diagonal Distillation student)
FLOW_DRAFTER_FILE = "diffusion_models/sdvg_toy_drafter.pt"
#: The toy DiTs' sampling schedule (timesteps on the 0..1000 scale, snapped to the shift-5 table): an MSE-trained
#: flow model's x0 prediction is only sharp at low noise, so the last step is at t = 100.
TOY_SCHEDULE = [[1000.0, 960.0, 900.0, 820.0, 720.0, 600.0, 460.0, 320.0, 200.0, 100.0]]
#: How the toy target re-noises between its steps: fresh noise (Self-Forcing's), since 2026-12-07. The current
#: target draws better with it than with Euler steps of the flow ODE ("predicted"): judge 0.733 [0.700, 0.767]
#: against 0.639 [0.595, 0.681], paired by caption +0.094 [+0.052, +0.135] on the 72 held-out captions × seeds 9001,
#: 9002, chosen on seed 9000 (bench/toy_heldout.py --step-noise; docs/TOY_WORLD.md, "Fifth sitting"). The first world's target drew flat fields with fresh noise (its x0
#: predictions stayed the blurry posterior mean); pass --step-noise predicted for such a model.
TOY_STEP_NOISE = "fresh"
TOY_SIZE = (64, 64)
TOY_BLOCKS = 3  # the training length: 9 latent frames, 33 pixel frames


def is_toy_tree(models_dir: str | Path | None) -> bool:
    """Whether ``models_dir`` holds the toy world's models (its stamp)."""
    return models_dir is not None and (Path(models_dir) / STAMP).is_file()


def read_stamp(models_dir: str | Path) -> dict:
    """A toy tree's stamp, parsed (OSError / ValueError when it is missing or broken)."""
    from ..loaders.stamp import read_stamp as read

    return read(Path(models_dir) / STAMP)


def toy_files(models_dir: str | Path = TOY_DIR) -> dict[str, Path]:
    """Role → file of a toy models tree; a ModelFileError names what is missing and how to make it."""
    root = Path(models_dir)
    try:
        files = {k: root / v for k, v in read_stamp(root)["files"].items()}
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFileError(f"{root} holds no toy-world models ({STAMP} is missing or broken: {exc}). "
                             "Run `python -m sdvg toy train` to train them.") from exc
    missing = [str(p) for p in files.values() if not p.exists()]
    if missing:
        raise ModelFileError(f"The toy-world models tree {root} lacks {', '.join(missing)}. "
                             "Run `python -m sdvg toy train` to (re)make them.")
    return files


def toy_drafter_sampling(models_dir: str | Path = TOY_DIR) -> dict[str, str]:
    """How a toy tree's drafter samples by default: the stamp's ``drafter_sampling`` (``schedule``, ``step_noise``; a
    distilled student: its own few-step schedule with fresh noise), or {} — the target's schedule and step noise (a
    flow-matching drafter trained like the target)."""
    try:
        sampling = read_stamp(models_dir).get("drafter_sampling") or {}
    except (OSError, ValueError):
        return {}
    return {k: str(sampling[k]) for k in ("schedule", "step_noise") if sampling.get(k)}


def toy_tree() -> Path:
    """The committed toy models tree, checked complete."""
    toy_files(TOY_DIR)
    return TOY_DIR


#: τ sweep of ``eval --world toy``, on the toy critic's scale (its labels run from −2, a wrong or broken frame, to
#: +2, a clean frame that matches its caption). Chosen from the block scores (worst frame) of 24 draft-only and
#: target-only videos: drafter blocks' 10/25/50/75/90 % quantiles −1.23, −1.21, −0.36, 0.28, 0.66; the target's
#: median 0.78.
TOY_TAUS = (-1.0, -0.3, 0.3, 0.6)
TOY_TAU = 0.3  # the default τ of `generate` on the toy models
#: frames the router scores per block on the toy models (`score_frames`): 2 of 12 cost 0.08 of a target block where
#: all 12 cost 0.35, and agree with the judge as well (bench/toy_critic_check.py; docs/TOY_WORLD.md)
TOY_SCORE_FRAMES = 2
TOY_EVAL_PROMPTS = 24
#: target rates of the toy evaluation's sdvg-rate rows (a τ that transfers: the quantile of the block scores seen so
#: far in the run). A rate is the drafter's share of *all* blocks; block 0 is the target's, so on 3 blocks the drafted
#: blocks' acceptance aims at rate × 3/2 (0.3, 0.6, 0.9). The prior (until scores are known): the drafter blocks'
#: median and spread above.
TOY_RATES = (0.2, 0.4, 0.6)
TOY_RATE_PRIOR = {"prior_mean": -0.36, "prior_std": 0.8}
TOY_EVAL_SEEDS = (0, 1)  # `eval --world toy`: every held-out caption (72) with each seed
TOY_QUICK = (8, (0,))  # `eval --world toy --quick`: 8 held-out captions, one seed (CI)


def toy_eval_items(quick: bool = False) -> tuple[list[str], list[int]]:
    """The toy evaluation's (prompt, seed) pairs: the 72 held-out captions no toy model was trained on, each with
    every seed of :data:`TOY_EVAL_SEEDS` (144 pairs); ``quick``: :data:`TOY_QUICK` (captions spread over all 72)."""
    from .world import held_out_captions

    captions, seeds = held_out_captions(), TOY_EVAL_SEEDS
    if quick:
        n, seeds = TOY_QUICK
        captions = held_out_captions(n)
    return [c for s in seeds for c in captions], [s for s in seeds for _ in captions]


def toy_prompts(n: int = TOY_EVAL_PROMPTS, seed: int = 2026) -> list[str]:
    """``n`` distinct captions of the first world (72, the palette the committed models were trained on) drawn with
    a seed: the contact sheet's and the first evaluation's prompt set (the evaluation now uses
    :func:`toy_eval_items`)."""
    import torch

    from .world import v1_captions

    captions = v1_captions()
    order = torch.randperm(len(captions), generator=torch.Generator().manual_seed(seed)).tolist()
    return [captions[i] for i in order[:n]]
