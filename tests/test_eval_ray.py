"""``sdvg eval --ray``: a local Ray cluster of 2 CPU actors on the tiny models writes the single-process CSV.

Skipped where ray is not installed (it is an optional extra, ``pip install ".[ray]"``, and not in CI's requirements).
"""

from __future__ import annotations

import csv

import pytest

ray = pytest.importorskip("ray", reason="ray is an optional extra (pip install '.[ray]'); not installed here")

TIMING = {"wall_s", "speedup"}  # the only columns that depend on the machine's speed


def _rows(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return {(r["prompt_id"], r["method"], r["tau"]): {k: v for k, v in r.items() if k not in TIMING}
                for r in csv.DictReader(fh)}


def test_ray_eval_with_two_actors_equals_the_single_process_csv(tiny_dir, tmp_path):
    from sdvg.eval import run as ev
    from sdvg.eval.ray import evaluate_ray
    from sdvg.loaders.bundle import load_models
    from sdvg.sampling.sampler import SamplerConfig

    prompts = ["a red fox running through snow", "a lighthouse at dusk", "a bowl of fruit on a table"]
    config = SamplerConfig(num_blocks=2, width=32, height=32)
    kw = {"taus": (-0.6,), "methods": ("target-only", "draft-only", "sdvg", "random"), "sampler_config": config,
          "save_videos": False, "warmup": False}
    models = load_models(tiny_dir, dit_device="cpu", aux_device="cpu", dtype="fp32")
    single = ev.evaluate(models, prompts, tmp_path / "single", **kw)
    load = {"models_dir": tiny_dir, "dit_device": "cpu", "aux_device": "cpu", "dtype": "fp32", "threads": 1}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        first = evaluate_ray("auto", load, prompts[:2], tmp_path / "ray", actors=2, **kw)  # interrupted: 2 of 3
        res = evaluate_ray("auto", load, prompts, tmp_path / "ray", actors=2, **kw)  # resumed
    finally:
        ray.shutdown()
    assert first["complete"] and first["written"] == 8 and not first["failed"]
    assert res["complete"] and res["skipped"] == 8 and res["written"] == 4 and not res["failed"]
    assert _rows(tmp_path / "ray" / ev.RESULTS) == _rows(tmp_path / "single" / ev.RESULTS)
    assert single["complete"]
