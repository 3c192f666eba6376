"""Training in several processes (its own file, so that the suite's workers take it beside test_train_diagonal.py):
two gloo processes under torchrun equal one process with DDP and FSDP2, and the GPU check's real-size training step
at tiny shapes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from sdvg.toy.preset import FLOW_DRAFTER_FILE, TOY_DIR, toy_files

FLOW_DRAFTER = TOY_DIR / FLOW_DRAFTER_FILE  # the small flow-matching toy drafter: teacher, fake score and student


def _run(args: list[str], env: dict, torchrun: bool) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if torchrun else []
    return subprocess.run([sys.executable, *launcher, *args], check=True, env=env, capture_output=True, text=True,
                          timeout=300)


def _same_run(a_dir, b_dir, world: int) -> None:
    a, b = (json.loads((d / "train.json").read_text()) for d in (a_dir, b_dir))
    assert a["world_size"] == 1 and b["world_size"] == world
    for key in a["losses"]:
        for (sa, va), (sb, vb) in zip(a["losses"][key], b["losses"][key], strict=True):
            assert sa == sb and vb == pytest.approx(va, rel=1e-4, abs=1e-6), key
    wa, wb = (torch.load(d / "student.pt", weights_only=True) for d in (a_dir, b_dir))
    for part in ("generator", "generator_ema"):
        diff = max(float((wa[part][k] - wb[part][k]).abs().max()) for k in wa[part])
        assert diff < 2e-5, (part, diff)
    fa, fb = (torch.load(d / "state.pt", weights_only=True)["fake"] for d in (a_dir, b_dir))
    assert max(float((fa[k] - fb[k]).abs().max()) for k in fa) < 2e-5


def test_two_gloo_processes_equal_one_process_ddp_and_fsdp2(tmp_path):
    """torchrun --nproc_per_node 2 (gloo) = one process, same seed and global batch: same losses and weights within
    float rounding, with DDP (max |Δw| < 2e-5 after 3 steps of a 2e-4 learning rate) and with FSDP2 (``--fsdp``:
    student, teacher, fake score and EMA sharded; here trained 2 steps, then resumed to 3). The small toy drafter is
    teacher, fake score and student, so each run is quick. FSDP2's shards hold exactly the memory plan's bytes over the two ranks (the teacher in fp32 on
    the CPU, the plan's bf16 × 2), each rank within 5 % of the plan's per-GPU estimate (measured within 0.6 %)."""
    from sdvg.loaders.wan import inspect_dit_checkpoint
    from sdvg.train.plan import dit_param_count, memory_plan

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (os.getcwd(), os.environ.get("PYTHONPATH"))))}
    small = str(FLOW_DRAFTER)  # the small drafter as teacher, fake score and student: the same code, a quarter the time
    prompts = tmp_path / "p.txt"  # 6 captions, not the bank's 144: each process encodes them all at start (~4 s)
    prompts.write_text("\n".join(f"a {c} {s} moving left on a black background" for c in ("red", "blue")
                                 for s in ("circle", "square", "triangle")) + "\n")
    (tmp_path / "c.json").write_text(json.dumps({"ode_pairs": 8, "gen_every": 1, "student_init": small, "teacher": small,
                                                 "data": str(prompts), "text_encoder": str(toy_files()["text_encoder"])}))
    args = ["-m", "sdvg", "train", "diagonal", "--config", str(tmp_path / "c.json"), "--batch", "4", "--threads", "1"]
    one, two, fsdp = tmp_path / "one", tmp_path / "two", tmp_path / "fsdp"
    _run([*args, "--max-steps", "3", "--out", str(one)], env, False)
    for d in (two, fsdp):  # the same teacher pairs (made once: their key matches), as the recipe shares them
        d.mkdir()
        for made in ("ode_pairs.pt", "text_embeds.pt"):
            shutil.copy(one / made, d / made)
    _run([*args, "--max-steps", "3", "--out", str(two)], env, True)
    _same_run(one, two, 2)
    _run([*args, "--max-steps", "2", "--out", str(fsdp), "--fsdp"], env, True)
    resumed = _run([*args, "--max-steps", "3", "--out", str(fsdp), "--fsdp"], env, True)
    assert "resuming from step 2 of 3" in resumed.stderr
    _same_run(one, fsdp, 2)
    measured = json.loads((fsdp / "train.json").read_text())["fsdp_bytes_per_rank"]
    own = dict.fromkeys(("teacher", "fake_score", "student", "student_ema"), FLOW_DRAFTER)
    per_param = {"teacher": 4, "student": 16, "student_ema": 4, "fake_score": 16}
    for key, ranks in measured.items():
        config = inspect_dit_checkpoint(own[key]).config
        assert sum(ranks) == per_param[key] * dit_param_count(config)[0], (key, ranks)
        plan = memory_plan(config=config, gpus=2, num_frames=9, latent_hw=(8, 8))
        estimate = plan[key] * (2 if key == "teacher" else 1)  # the plan's teacher is bf16; on the CPU it is fp32
        assert all(abs(r - estimate) <= 0.05 * estimate for r in ranks), (key, ranks, estimate)


def test_real_size_training_check_runs_its_path_at_tiny_shapes(tmp_path):
    """bench/train_real_size.py (the GPU check's training step) on the CPU at tiny shapes: the same code path."""
    out = tmp_path / "t.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (os.getcwd(), os.environ.get("PYTHONPATH"))))}
    subprocess.run([sys.executable, "bench/train_real_size.py", "--shape", "tiny", "--device", "cpu", "--steps", "1",
                    "--out", str(out)], check=True, env=env, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["steps"] == 1 and res["s_per_iter"] > 0 and res["plan_total_gib_1gpu"] > 0
