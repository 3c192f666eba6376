"""Training as a user runs it (issue 25, goal 5): every config error is an exit-2 message before anything loads,
Ctrl-C / SIGTERM save the state and exit 130 / 143, a rerun resumes and says so without -v, and ``save_every`` is
bounded in minutes as well as iterations."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from sdvg.loaders.checkpoint import torch_load
from sdvg.toy.preset import FLOW_DRAFTER_FILE, TOY_DIR, toy_files
from sdvg.train import load_config, train_diagonal

# a fast toy run: the small flow-matching drafter as student, teacher and fake score (the defaults, the toy
# target's weights, are several times the work), 2 videos a step, no ODE pairs
_SMALL = str(TOY_DIR / FLOW_DRAFTER_FILE)
FAST = {"batch": 2, "regression_weight": 0.0, "gen_every": 1, "student_init": _SMALL, "teacher": _SMALL}


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> dict:
    """FAST on 4 captions instead of the toy bank's 144 (each run encodes its bank at start: ~4 s for the bank)."""
    prompts = tmp_path_factory.mktemp("prompts") / "p.txt"
    prompts.write_text("\n".join(f"a {c} circle moving {d} on a black background" for c in ("red", "blue")
                                 for d in ("left", "right")) + "\n")
    return {**FAST, "data": str(prompts), "text_encoder": str(toy_files()["text_encoder"])}

BAD = [
    ({"lr": -1}, "lr must be > 0, got -1"),
    ({"batch": "eight"}, "batch must be int, got 'eight'"),
    ({"betas": [0.9, "x"]}, "betas must be a [float, float] list"),
    ({"latent_hw": 8}, "latent_hw must be a [int, int] list"),
    ({"ema": 1.5}, "ema must be in [0, 1)"),
    ({"steps": 2.5}, "steps must be int"),
    ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be bool"),
    ({"lr_fake": True}, "lr_fake must be float"),
    ({"schedule": "zigzag"}, "schedule: Cannot parse step schedule 'zigzag'"),
    ({"save_every_minutes": -1}, "save_every_minutes must be >= 0"),
    ({"learning_rate": 1e-4}, "Unknown training config key(s) ['learning_rate']"),
]

_PROBE = """
import json, sys
from sdvg.cli.commands import main
for config in sys.argv[2:]:
    rc = main(["train", "diagonal", "--config", config, "--out", sys.argv[1]])
    heavy = [m for m in ("sdvg.train.loop", "sdvg.loaders.wan", "sdvg.models.dit") if m in sys.modules]
    sys.stderr.write("@@\\n")
    print(json.dumps({"rc": rc, "heavy": heavy}))
"""


def test_every_config_error_is_an_exit_2_message_before_anything_loads(tmp_path):
    """Each bad config in its own CLI call (one fresh interpreter for all): exit 2, the message names the key and
    what it must be, no traceback, and neither the training loop nor a model module was imported."""
    paths = []
    for i, (cfg, _) in enumerate(BAD):
        paths.append(tmp_path / f"c{i}.json")
        paths[-1].write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "o"), *map(str, paths)],
                       env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True, timeout=120)
    results = [json.loads(line) for line in r.stdout.strip().splitlines()]
    messages = r.stderr.split("@@\n")
    assert len(results) == len(BAD), r.stderr
    for (cfg, message), got, err in zip(BAD, results, messages, strict=False):
        assert got == {"rc": 2, "heavy": []}, (cfg, err)
        assert message in err and "Traceback" not in err, (cfg, err)
    assert not (tmp_path / "o").exists()


ENV = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}


def _args(out, steps: int, config) -> list[str]:
    return [sys.executable, "-m", "sdvg", "train", "diagonal", "--config", str(config), "--out", str(out),
            "--max-steps", str(steps), "--threads", "1"]


def _start(out, steps: int, config) -> subprocess.Popen:
    return subprocess.Popen(_args(out, steps, config), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _signal_after_first_step(p: subprocess.Popen, sig: int) -> tuple[int, str]:
    """Wait for the first progress line (one iteration done), send ``sig``, return the exit code and stderr."""
    seen = []
    for line in p.stderr:
        seen.append(line)
        if line.startswith("["):
            p.send_signal(sig)
            break
    rest = p.communicate(timeout=120)[1]
    return p.returncode, "".join(seen) + rest


def test_sigterm_and_ctrl_c_save_the_state_and_a_rerun_resumes_and_says_so(tmp_path, fast):
    """SIGTERM mid-run: exit 143, state.pt holds the steps done (save_every is far away); the rerun says it resumes
    (no -v) and Ctrl-C then exits 130 with its steps saved; the last rerun finishes at the asked step."""
    config = tmp_path / "c.json"
    config.write_text(json.dumps({**fast, "save_every": 1000, "save_every_minutes": 0}))
    out = tmp_path / "run"
    rc, err = _signal_after_first_step(_start(out, 500, config), signal.SIGTERM)
    assert rc == 143, err
    first = int(torch_load(out / "state.pt")["step"])
    assert 1 <= first < 500 and "SIGTERM" in err and f"stopped at step {first} of 500" in err
    assert (out / "student.pt").is_file() and json.loads((out / "train.json").read_text())["steps"] == first

    rc, err = _signal_after_first_step(_start(out, 500, config), signal.SIGINT)
    assert rc == 130, err
    assert f"resuming from step {first} of 500" in err
    second = int(torch_load(out / "state.pt")["step"])
    assert first < second < 500

    r = subprocess.run(_args(out, second + 1, config), env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"resuming from step {second} of {second + 1}" in r.stderr, r.stderr
    st = torch_load(out / "state.pt")
    assert st["step"] == second + 1 and [s for s, _ in st["losses"]["fake"]] == list(range(1, second + 2))


@pytest.mark.parametrize("minutes, saves", [(1e-9, [None, 1, 2, 3]), (0.0, [None, None, None, None])])
def test_save_every_is_bounded_in_minutes_as_well_as_iterations(tmp_path, fast, minutes, saves):
    """With save_every far away, a (tiny) minute bound saves after every iteration and 0 turns it off: ``stop()``,
    asked after each iteration before its save, sees state.pt one iteration behind (or absent)."""
    out = tmp_path / "m"
    cfg = load_config(None, **fast, out=str(out), steps=4, save_every=1000, save_every_minutes=minutes)
    seen = []

    def stop() -> bool:
        seen.append(int(torch_load(out / "state.pt")["step"]) if (out / "state.pt").is_file() else None)
        return False

    res = train_diagonal(cfg, stop=stop)
    assert seen == saves and res.steps == 4 and not res.interrupted
    assert int(torch_load(out / "state.pt")["step"]) == 4  # the last step always saves


def test_the_toy_prompt_bank_holds_the_training_captions_only():
    """Training on "toy" never reads a held-out caption: the evaluations judge those as new combinations."""
    from sdvg.toy.world import held_out_captions, train_captions
    from sdvg.train.data import load_prompts

    bank = load_prompts("toy", None, None)
    assert sorted(bank.prompts) == sorted(train_captions())
    assert not set(bank.prompts) & set(held_out_captions())
