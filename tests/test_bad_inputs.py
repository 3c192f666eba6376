"""The bad-input sweep: every case through the real CLI (in-process) ends in exit code 2 with its own message and no
traceback, before any run starts. One row per case: (class, arguments, the fragment the message must contain)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from safetensors.torch import save_file

from sdvg.cli.commands import main

V, TE = "vae/sdvg_tiny_vae.safetensors", "text_encoders/sdvg_tiny_umt5.safetensors"
DRAFTER, TARGET = "diffusion_models/sdvg_tiny_drafter.pt", "diffusion_models/sdvg_tiny_target.safetensors"
GEN = ["generate", "--prompt", "x", "--models", "{models}", "--device", "cpu"]
OUT = ["--out", "{t}/v.mp4"]
EVAL = ["eval", "--prompts", "{t}/p.txt", "--out", "{t}/ev", "--models", "{models}"]
BENCH = ["bench", "--models", "{models}"]


def target_only(target, vae=V, te=TE):
    return ["generate", "--prompt", "x", "--mode", "target-only", "--device", "cpu", "--target", target, "--vae",
            "{models}/" + vae, "--text-encoder", "{models}/" + te, *OUT]


CASES = [
    ("outputs", GEN + ["--out", "{t}/v.gif"], "the file must end in .mp4 (got '.gif')"),
    ("outputs", GEN + ["--out", "{t}/v"], "got no extension"),
    ("outputs", GEN + ["--out", "{t}/dir.mp4"], "is a directory"),
    ("outputs", GEN + ["--out", "{t}/file.txt/v.mp4"], "is a file, not a folder"),
    ("outputs", GEN + ["--out", ""], "--out is empty"),
    ("outputs", GEN + OUT + ["--report", "{t}/r.txt"], "--report {t}/r.txt: the file must end in .json"),
    ("outputs", GEN + OUT + ["--timeline", "{t}/t.mp4"], "the file must end in .png"),
    ("outputs", GEN + OUT + ["--save-latents", "{t}/a.safetensors", "--save-frames", "{t}/a.safetensors"],
     "are the same file"),
    ("outputs", GEN + OUT + ["--save-latents", "{t}/model.safetensors"], "is an existing model file"),
    ("outputs", GEN + OUT + ["--save-frames", "{models}/" + DRAFTER], "the file must end in .safetensors"),
    ("settings", GEN + OUT + ["--width", "50"], "multiples of 16, got 50×64"),
    ("settings", GEN + OUT + ["--width", "0"], "multiples of 16, got 0×64"),
    ("settings", GEN + OUT + ["--height", "-16"], "multiples of 16"),
    ("settings", GEN + OUT + ["--blocks", "0"], "num_blocks must be at least 1"),
    ("settings", GEN + OUT + ["--blocks", "-2"], "num_blocks must be at least 1"),
    ("settings", GEN + OUT + ["--frames", "0"], "num_frames 0 does not fit"),
    ("settings", GEN + OUT + ["--seed", "-1"], "seed must be a non-negative integer"),
    ("settings", GEN + OUT + ["--schedule", "500,750"], "not strictly decreasing"),
    ("settings", GEN + OUT + ["--schedule", "0,500"], "timesteps must satisfy 0 < t <= 1000"),
    ("settings", GEN + OUT + ["--schedule", "[oops"], "--schedule is not valid JSON"),
    ("settings", GEN + OUT + ["--schedule", "[[1000,500],[1000,250],[1000,100]]", "--blocks", "2"], "3 per-block lists"),
    ("settings", GEN + OUT + ["--refine-from-step", "0"], "refine_from_step must be between 1 and 3"),
    ("settings", GEN + OUT + ["--refine-from-step", "99"], "refine_from_step must be between 1 and 3"),
    ("settings", GEN + OUT + ["--cache", "noisy", "--window", "4"], "window_frames (4) must be at least"),
    ("settings", GEN + OUT + ["--cache", "noisy", "--sinks", "-1"], "sink_frames must be >= 0"),
    ("settings", GEN + OUT + ["--mode", "random", "--random-rate", "1.5"], "random_rate must be in [0, 1]"),
    ("settings", GEN + OUT + ["--quantile", "0"], "quantile q must be strictly between 0 and 1"),
    ("settings", GEN + OUT + ["--delta", "-1"], "delta (relative margin) must be >= 0"),
    ("settings", GEN + OUT + ["--mode", "pattern"], "--pattern goes with --mode pattern"),
    ("settings", GEN + OUT + ["--pattern", "AA"], "--pattern goes with --mode pattern"),
    ("settings", GEN + OUT + ["--mode", "pattern", "--pattern", "AXR"], "string of A (accept) and R (reject)"),
    ("settings", GEN + OUT + ["--mode", "pattern", "--pattern", "AR", "--blocks", "7"], "give one entry per drafted"),
    # only a run that keeps every frame in RAM is refused (--out alone streams them to the mp4)
    ("settings", GEN + OUT + ["--blocks", "100000", "--width", "2048", "--height", "2048", "--save-frames",
                              "{t}/f.safetensors"], "GiB for the output frames"),
    ("settings", GEN + OUT + ["--frames", "10000000", "--save-latents", "{t}/l.safetensors"], "GiB for the output frames"),
    ("argparse", GEN + OUT + ["--tau", "nan"], "NaN is not a valid value"),
    ("argparse", GEN + OUT + ["--tau", "abc"], "argument --tau"),
    ("argparse", GEN + OUT + ["--cache", "rolling"], "invalid choice: 'rolling'"),
    ("argparse", GEN + OUT + ["--dtype", "int4"], "invalid choice: 'int4'"),
    ("argparse", GEN + OUT + ["--mode", "fast"], "invalid choice: 'fast'"),
    ("argparse", GEN + OUT + ["--mode", "speculative"], "invalid choice: 'speculative'"),  # one name: reward
    ("argparse", GEN + OUT + ["--blocks", "3", "--frames", "20"], "not allowed with argument --blocks"),
    ("devices", GEN + OUT + ["--threads", "0"], "--threads must be a whole number ≥ 1"),
    ("devices", GEN + OUT + ["--threads", "-1"], "--threads must be a whole number ≥ 1"),
    ("devices", GEN + OUT + ["--threads", "100000"], "more than this machine can use"),
    ("devices", GEN[:-2] + ["--device", "meta", *OUT], "PyTorch's 'meta' device"),
    ("devices", GEN[:-2] + ["--device", "tpu:0", *OUT], "Unknown device 'tpu:0'"),
    ("devices", GEN + OUT + ["--aux-device", "xla"], "which SDVG does not run on"),
    ("model files", target_only("{t}/fake.safetensors"), "this is a PNG image, not a checkpoint"),
    ("model files", target_only("{t}/page.safetensors"), "this is an HTML web page"),
    ("model files", target_only("{t}/lfs.safetensors"), "Git LFS pointer"),
    ("model files", target_only("{t}/dangling.safetensors"), "is a broken symbolic link"),
    ("model files", target_only("{t}/empty.pt"), "the file is empty (0 bytes)"),
    ("model files", target_only("{models}/" + V), "not a Wan 2.1 DiT"),
    ("model files", target_only("{t}/nope.safetensors"), "does not exist"),
    ("model files", target_only("{models}/" + TARGET, vae=TARGET), "is not a Wan 2.1 VAE"),
    ("model files", target_only("{models}/" + TARGET, te=V), "not a UMT5 text encoder"),
    ("model files", ["generate", "--prompt", "x", "--models", "{t}/nowhere", *OUT], "No 'diffusion_models' folder"),
    ("eval", EVAL + ["--limit", "0"], "--limit must be a whole number ≥ 1"),
    ("eval", EVAL + ["--limit", "-1"], "--limit must be a whole number ≥ 1"),
    ("eval", EVAL + ["--max-rows", "-3"], "--max-rows must be a whole number ≥ 1"),
    ("eval", EVAL + ["--methods", ","], "Unknown or empty --methods"),
    ("eval", EVAL + ["--taus", "x"], "--taus must be comma-separated numbers"),
    ("eval", ["eval", "--prompts", "{t}/latin.txt", "--out", "{t}/ev", "--models", "{models}"], "is not UTF-8 text"),
    ("eval", ["eval", "--prompts", "{t}/p.txt", "--out", "{t}/file.txt", "--models", "{models}"], "is a file, not a"),
    ("eval", ["eval", "--prompts", "{t}/none.txt", "--out", "{t}/ev", "--models", "{models}"], "No prompt file"),
    ("eval", EVAL + ["--metric", "nomodule:fn"], "cannot import module 'nomodule'"),
    ("bench", BENCH + ["--blocks", "0"], "--blocks must be at least 2"),
    ("bench", BENCH + ["--blocks", "1"], "--blocks must be at least 2"),
    ("bench", BENCH + ["--repeats", "0"], "--repeats must be at least 1"),
    ("bench", BENCH + ["--interleave", "-1"], "--interleave must be at least 0"),
    ("bench", BENCH + ["--levels", "150"], "--levels must be in [0, 1]"),
    ("bench", BENCH + ["--only", "nothing"], "no row or group named 'nothing'"),
    ("bench", BENCH + ["--json", "{t}/b.txt"], "--json {t}/b.txt: the file must end in .json"),
    ("bench", BENCH + ["--plot", "{t}/dir.mp4"], "the file must end in .png (got '.mp4')"),
]


@pytest.fixture(scope="module")
def place(tiny_dir, tmp_path_factory):
    t = tmp_path_factory.mktemp("bad-inputs")
    (t / "dir.mp4").mkdir()
    (t / "file.txt").write_text("x")
    (t / "fake.safetensors").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    (t / "page.safetensors").write_text("<!DOCTYPE html><html>login</html>")
    (t / "lfs.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 28577103288\n")
    (t / "dangling.safetensors").symlink_to(t / "gone.safetensors")
    (t / "empty.pt").write_bytes(b"")
    (t / "latin.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (t / "p.txt").write_text("a fox\n")
    save_file({"w": torch.zeros(2)}, str(t / "model.safetensors"))
    return {"t": str(t), "models": str(tiny_dir)}


@pytest.mark.parametrize(("kind", "argv", "message"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_bad_input_exits_2_with_its_own_message(place, kind, argv, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([a.format(**place) for a in argv])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
    text = err.getvalue()
    assert code == 2, text
    assert message.format(**place) in text and "Traceback" not in text


def test_the_sweep_covers_every_class_more_than_once():
    kinds = [c[0] for c in CASES]
    counts = {k: kinds.count(k) for k in set(kinds)}
    assert set(counts) == {"outputs", "settings", "argparse", "devices", "model files", "eval", "bench"}
    assert min(counts.values()) >= 6 and len(CASES) >= 70
