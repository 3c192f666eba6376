"""The `python -m sdvg` CLI on the tiny preset: outputs, options, and clear failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from sdvg.cli.commands import main
from sdvg.outputs import read_video_frames


def test_generate_writes_all_outputs(tiny_dir, tmp_path, capsys):
    out = tmp_path / "v.mp4"
    code = main([
        "generate", "--prompt", "a cat", "--models", str(tiny_dir), "--device", "cpu", "--blocks", "3",
        "--out", str(out), "--report", str(tmp_path / "r.json"), "--save-latents", str(tmp_path / "l.safetensors"),
        "--save-frames", str(tmp_path / "f.safetensors"), "--timeline", str(tmp_path / "t.png"),
        "--tau=-inf", "--cache", "global", "--seed", "7",
    ])
    assert code == 0
    assert len(read_video_frames(out)) == 33
    report = json.loads((tmp_path / "r.json").read_text())
    assert [b["produced_by"] for b in report["blocks"]] == ["target", "drafter", "drafter"]
    assert report["settings"]["seed"] == 7 and report["settings"]["cache"] == "global"
    assert report["settings"]["router"]["tau"] == "-inf"
    assert load_file(str(tmp_path / "l.safetensors"))["latents"].shape == (1, 16, 9, 8, 8)
    frames = load_file(str(tmp_path / "f.safetensors"))["frames"]
    assert frames.shape == (33, 64, 64, 3) and str(frames.dtype) == "torch.uint8"
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert "block 2" in capsys.readouterr().out


def test_frames_option_trims_and_modes(tiny_dir, tmp_path):
    out = tmp_path / "v.mp4"
    code = main([
        "generate", "--prompt", "x", "--models", str(tiny_dir), "--device", "cpu", "--frames", "20",
        "--mode", "random", "--random-rate", "0", "--schedule", "diagonal", "--cache", "noisy",
        "--out", str(out), "--report", str(tmp_path / "r.json"),
    ])
    assert code == 0
    assert len(read_video_frames(out)) == 20
    report = json.loads((tmp_path / "r.json").read_text())
    assert [b["steps"] for b in report["blocks"]] == [4, 3]
    assert report["blocks"][1]["decision"] == "reject"


def test_missing_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope.safetensors"
    code = main(["generate", "--prompt", "x", "--target", str(missing), "--mode", "target-only", "--out", str(tmp_path / "v.mp4")])
    assert code == 2
    assert str(missing) in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--width", "50"], "multiples of 16"),
        (["--width", "0"], "multiples of 16"),  # 0 is not "the default"
        (["--blocks", "0"], "num_blocks must be at least 1"),
        (["--tau", "nan"], "NaN is not a valid value"),
        (["--threads", "0"], "--threads must be"),
        (["--schedule", "500,750"], "not strictly decreasing"),
        (["--cache", "noisy", "--window", "4"], "window_frames (4) must be at least"),
        (["--mode", "pattern"], "--pattern goes with --mode pattern"),
        (["--mode", "pattern", "--pattern", "AXR"], "string of A (accept) and R (reject)"),
        (["--mode", "pattern", "--pattern", "AR", "--blocks", "7"], "one entry per drafted block"),
    ],
)
def test_bad_settings_exit_with_their_own_message_before_any_model_loads(tmp_path, capsys, bad, message):
    missing = tmp_path / "not-there.safetensors"  # loading it would fail: the setting must be refused first
    try:
        code = main(["generate", "--prompt", "x", "--target", str(missing), "--drafter", str(missing), "--device",
                     "cpu", "--out", str(tmp_path / "v.mp4"), *bad])
    except SystemExit as exc:  # argparse refuses its own types with exit code 2
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "not-there" not in err
    assert not (tmp_path / "v.mp4").exists()


def test_cli_exit_code_is_2_in_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sdvg", "generate", "--prompt", "x", "--width", "50",
                           "--out", str(tmp_path / "v.mp4")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "multiples of 16" in proc.stderr


def test_make_tiny_command(tmp_path):
    assert main(["make-tiny", str(tmp_path / "m")]) == 0
    for folder in ("diffusion_models", "vae", "text_encoders", "image_reward"):
        assert any((tmp_path / "m" / folder).iterdir())


@pytest.mark.parametrize(("signame", "code", "said"), [("SIGINT", 130, "Ctrl-C"), ("SIGTERM", 143, "SIGTERM")])
def test_a_stop_signal_writes_the_partial_video_and_report(tiny_dir, tmp_path, signame, code, said):
    """Ctrl-C and SIGTERM (container stops, timeout, job schedulers) stop after the current step; the finished blocks
    are written."""
    import signal

    out, rep = tmp_path / "v.mp4", tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdvg", "generate", "--prompt", "x", "--models", str(tiny_dir), "--device", "cpu",
         "--threads", "1", "--blocks", "40", "--mode", "target-only", "--out", str(out), "--report", str(rep)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for line in proc.stderr:
            if " 2/40 " in line:  # the progress line of block 2
                proc.send_signal(getattr(signal, signame))
                break
        stdout, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == code
    report = json.loads(rep.read_text())
    assert report["partial"] is True
    finished = len(report["blocks"])
    assert 2 <= finished < 40
    assert len(read_video_frames(out)) == 12 * finished - 3
    assert "(partial)" in stdout and f"{said}: stopping after the current step" in err


def test_set_cpu_threads_sets_validates_and_keeps_torch_choice_without_a_number():
    import torch

    from sdvg.devices import set_cpu_threads
    from sdvg.errors import ConfigError

    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(None) == before  # nothing asked: torch's choice stays
        assert set_cpu_threads(None, 1) == 1 == torch.get_num_threads()
        assert set_cpu_threads(2, 1) == 2
        for bad in (0, -3, 1.5, True):
            with pytest.raises(ConfigError, match="--threads"):
                set_cpu_threads(bad)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--limit", "0"], "--limit must be a whole number ≥ 1"),
        (["--limit", "-1"], "--limit must be a whole number ≥ 1"),
        (["--max-rows", "-3"], "--max-rows must be a whole number ≥ 1"),
        (["--out", "{prompts}"], "is a file, not a folder"),
        (["--methods", ","], "Unknown or empty --methods"),
        (["--methods", "sdvg,fast"], "Unknown or empty --methods ['fast']"),
        (["--taus", "a,b"], "--taus must be comma-separated numbers"),
    ],
)
def test_eval_refuses_bad_arguments_before_any_model_loads(tmp_path, capsys, extra, message):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a fox\n", encoding="utf-8")
    missing = tmp_path / "not-there.safetensors"
    extra = [e.format(prompts=prompts) for e in extra]
    out = [] if "--out" in extra else ["--out", str(tmp_path / "ev")]
    code = main(["eval", "--prompts", str(prompts), *out, "--target", str(missing), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "not-there" not in err


BLAS_PROBE = """
import os, runpy, sys
sys.argv = ["sdvg", "--help"]
try:
    runpy.run_module("sdvg", run_name="__main__")
except SystemExit:
    pass
import numpy, torch
print(os.environ["OPENBLAS_NUM_THREADS"], len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize(("user", "expected"), [(None, "1"), ("2", "2")])
def test_cli_starts_no_openblas_workers_unless_asked(user, expected):
    """The exit hang seen once (numpy's OpenBLAS joining its workers at exit): the CLI starts none, unless the user
    sets OPENBLAS_NUM_THREADS."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if user is not None:
        env["OPENBLAS_NUM_THREADS"] = user
    out = subprocess.run([sys.executable, "-c", BLAS_PROBE], env=env, capture_output=True, text=True, timeout=120)
    value, threads = out.stdout.split()[-2:]
    assert value == expected, out.stdout + out.stderr
    assert (threads == "1") == (user is None) or os.cpu_count() == 1, out.stdout
