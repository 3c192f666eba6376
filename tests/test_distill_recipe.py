"""bench/distill_recipe.py's ablation variants (issue 25, goal 3): each is the recipe's DMD stage with exactly the one
change it names, a config the trainer accepts, and is checked on the schedule and cache it trains with."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import distill_recipe  # noqa: E402

from sdvg.train import load_config  # noqa: E402

CHANGES = {"diagonal": {}, "no-flow": {"flow_weight": 0.0}, "clean-cache": {"cache": "clean"},
           "constant": {"schedule": "constant"}}


def _args(tmp_path: Path, variant: str) -> argparse.Namespace:
    return argparse.Namespace(out=str(tmp_path), pairs=8, batch=2, dmd_lr=2e-5, fake_lr=1e-4, dmd_regression=0.0,
                              chunk=10, variant=variant)


@pytest.mark.parametrize("variant", distill_recipe.ABLATIONS)
def test_each_ablation_changes_only_what_it_names(tmp_path, variant):
    recipe = distill_recipe.dmd_config(_args(tmp_path, "diagonal"), Path("student.pt"))
    cfg = distill_recipe.dmd_config(_args(tmp_path, variant), Path("student.pt"))
    changed = {k: v for k, v in cfg.items() if recipe.get(k) != v}
    assert changed == CHANGES[variant]
    trained = load_config(None, **{**cfg, "out": str(tmp_path / "run")})  # the trainer's own checks pass
    assert trained.flow_weight == cfg.get("flow_weight", 0.2)
    how = distill_recipe.variant_sampling(variant)
    assert how.get("cache", "noisy") == trained.cache  # checked as trained
    assert how.get("schedule", "diagonal") == trained.schedule


def test_rows_that_are_not_ablations_sample_as_the_recipe():
    """The undistilled and ``--extra`` rows of distill_ablation take the recipe's sampling; folders are named apart."""
    assert distill_recipe.variant_sampling("undistilled (target weights, diagonal)") == {}
    assert distill_recipe.stage_name("dmd-from-teacher", "diagonal") == "dmd-from-teacher"
    assert distill_recipe.stage_name("dmd-warm", "constant") == "dmd-warm-constant"


def test_the_ode_stage_starts_from_the_teacher_unless_told(tmp_path):
    """``--ode-init``: the ODE stage's starting weights (a smaller student's), else the teacher's — a config the
    trainer accepts either way."""
    from sdvg.toy.preset import toy_files

    args = argparse.Namespace(out=str(tmp_path), pairs=8, batch=2, ode_lr=1e-4, chunk=10, ode_init=None)
    assert distill_recipe.ode_config(args)["student_init"] == str(toy_files()["target"])
    args.ode_init = str(tmp_path / "small.pt")
    cfg = distill_recipe.ode_config(args)
    assert cfg["student_init"] == args.ode_init and cfg["dmd_weight"] == 0.0
    assert load_config(None, **{**cfg, "out": str(tmp_path / "run")}).student_init == args.ode_init
