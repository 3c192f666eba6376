"""The bad-input sweep: every case through the real CLI (in-process) ends in exit code 2 with its own message and no
traceback, before any run starts. One row per case: (class, arguments, the fragment the message must contain)."""

from __future__ import annotations

import contextlib
import io
import shutil
import struct
import zlib

import pytest
import torch
from PIL import Image
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
    ("eval", EVAL + ["--methods", "target-only,sdvg-rate"], "--methods sdvg-rate: the target-rate rows need target "
                                                            "rates: pass --rates"),
    ("eval", EVAL + ["--rates", "0.2,half"], "--rates must be comma-separated numbers, got '0.2,half'"),
    ("eval", EVAL + ["--methods", "target-only,sdvg-rate", "--rates", "1.5"], "strictly between 0 and 1, got [1.5]"),
    ("eval", EVAL + ["--methods", "target-only,random-rate", "--rates", "0.5", "--ray", "auto"], "are not run on Ray"),
    ("bench", BENCH + ["--blocks", "0"], "--blocks must be at least 2"),
    ("bench", BENCH + ["--blocks", "1"], "--blocks must be at least 2"),
    ("bench", BENCH + ["--repeats", "0"], "--repeats must be at least 1"),
    ("bench", BENCH + ["--interleave", "-1"], "--interleave must be at least 0"),
    ("bench", BENCH + ["--levels", "150"], "--levels must be in [0, 1]"),
    ("bench", BENCH + ["--only", "nothing"], "no row or group named 'nothing'"),
    ("bench", BENCH + ["--json", "{t}/b.txt"], "--json {t}/b.txt: the file must end in .json"),
    ("bench", BENCH + ["--plot", "{t}/dir.mp4"], "the file must end in .png (got '.mp4')"),
    # the second pass (#28): inputs that ran without a word, or with a misleading message
    ("inputs", ["generate", "--prompt", "", "--models", "{models}", *OUT], "--prompt is empty; describe the video"),
    ("inputs", ["generate", "--prompt", " \t\n ", "--models", "{models}", *OUT], "--prompt is empty"),
    ("inputs", GEN + OUT + ["--init-image", "{t}/bomb.png"], "its header claims more pixels than an image can safely"),
    ("inputs", GEN + OUT + ["--init-image", "{t}/one.png"], "is 1×1 but the output is 64×64; resize it to 64×64"),
    ("inputs", GEN + OUT + ["--init-image", "{t}/big.png"], "is 128×96 but the output is 64×64; pass --width 128 "
                                                            "--height 96, or resize it"),
    ("inputs", GEN + OUT + ["--target-lora", "{t}/model.safetensors:abc"], "the strength after ':' must be a number, "
                                                                          "got 'abc'"),
    ("inputs", GEN + OUT + ["--early-exit", "--aggregation", "mean"], "Early exit (stop scoring at the first frame "
                                                                     "below τ) decides a block only with mode 'reward', "
                                                                     "aggregation 'min'"),
    ("inputs", GEN + OUT + ["--early-exit", "--threshold", "target-rate"], "got threshold 'target-rate'"),
    ("inputs", GEN + OUT + ["--cache", "global", "--blocks", "400"], "exceed the RoPE range of 1024 frames"),
    ("inputs", GEN + OUT + ["--blocks", "10000000", "--width", "2048", "--height", "2048"],
     "This run's outputs need about"),
    ("inputs", GEN + OUT + ["--reward", "{t}/headless/sdvg_tiny_image_reward.pt"],
     "attention head counts cannot be read from the weights' shapes"),
    # training configs (every key's type and range: tests/test_train_user.py)
    ("settings", ["train", "diagonal", "--config", "{t}/lr.json", "--out", "{t}/tr"], "lr must be > 0, got -1"),
    ("settings", ["train", "diagonal", "--config", "{t}/batch.json", "--out", "{t}/tr"],
     "batch must be int, got 'eight'"),
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
    (t / "lr.json").write_text('{"lr": -1}')
    (t / "batch.json").write_text('{"batch": "eight"}')
    save_file({"w": torch.zeros(2)}, str(t / "model.safetensors"))
    (t / "bomb.png").write_bytes(png_header(100_000, 100_000))
    Image.new("RGB", (1, 1)).save(t / "one.png")
    Image.new("RGB", (128, 96)).save(t / "big.png")
    (t / "headless").mkdir()  # a reward checkpoint that is not the official one, without its .config.json
    for name in ("sdvg_tiny_image_reward.pt", "sdvg_tiny_image_reward.vocab.txt"):
        shutil.copy(tiny_dir / "image_reward" / name, t / "headless" / name)
    return {"t": str(t), "models": str(tiny_dir)}


def png_header(width: int, height: int) -> bytes:
    """A 100-byte PNG whose header claims ``width × height`` (its one data chunk holds a few bytes of pixels)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


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
    assert set(counts) == {"outputs", "settings", "argparse", "devices", "model files", "eval", "bench", "inputs"}
    assert min(counts.values()) >= 6 and len(CASES) >= 70


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_an_unknown_model_role_names_the_valid_ones(tiny_dir):
    from sdvg.errors import ConfigError
    from sdvg.loaders import load_models

    with pytest.raises(ConfigError, match=r"Unknown model role\(s\) \['foo'\] in need=; the roles are drafter, "
                                          r"target, vae, text_encoder, reward"):
        load_models(tiny_dir, need=("foo",))
    with pytest.raises(ConfigError, match=r"Unknown model role\(s\) \['target'\]"):  # a bare string, not a tuple
        load_models(tiny_dir, need="target")


def test_legal_but_suspicious_inputs_run_and_say_what_happened(tiny_dir, tmp_path, caplog):
    """A prompt past the text encoder's 512 tokens is cut (said, with where), and a drafter larger than its target
    (the two files swapped) runs with a warning; the run itself succeeds."""
    words = " ".join(f"word{i}" for i in range(10_000))
    code, out, err = run_cli(["generate", "--prompt", words, "--models", str(tiny_dir), "--device", "cpu",
                              "--blocks", "2", "--threads", "1", "--drafter", str(tiny_dir / TARGET),
                              "--target", str(tiny_dir / DRAFTER), "--out", str(tmp_path / "v.mp4")])
    assert code == 0, err
    said = caplog.text  # the CLI's warnings go through logging (to stderr outside pytest)
    assert "prompt truncated to 512 tokens (it has 40001" in said and "the words after about" in said
    assert "is larger than the target" in said and "were --drafter and --target swapped?" in said
    assert "Traceback" not in err and (tmp_path / "v.mp4").is_file()


# `python -m sdvg` with the import of the CLI made slow (a finder that sleeps when sdvg.cli.commands is imported,
# after saying so): the SIGINT then lands inside that import, wherever the machine's speed would put it
_SLOW_IMPORT = """import runpy, sys, time
class SlowImport:
    def find_spec(self, name, path=None, target=None):
        if name == "sdvg.cli.commands":
            sys.stderr.write("importing\\n"); sys.stderr.flush(); time.sleep(60)
sys.meta_path.insert(0, SlowImport())
sys.argv = ["sdvg", "inspect", "nothing.safetensors"]
runpy.run_module("sdvg", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_the_cli_imports_exits_130_without_a_traceback():
    import signal
    import subprocess
    import sys

    # a pytest-xdist worker ignores SIGINT and a child inherits that (then Python installs no Ctrl-C handler): the
    # child starts with the default disposition, as from a terminal
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_IMPORT], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr.readline() == "importing\n"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "aborted" and "Traceback" not in err


class _Recording(io.StringIO):
    """A non-terminal stream that records what was written before each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())


def test_the_progress_bar_is_fixed_width_with_an_eta_and_block_lines_are_flushed_as_they_finish():
    from types import SimpleNamespace

    from sdvg.cli.progress import BAR_WIDTH, Progress
    from sdvg.outputs import block_line

    record = SimpleNamespace(to_dict=lambda: {"block": 0, "decision": "accept", "produced_by": "drafter", "drafted": True,
                                              "q": 0.5, "reason": "q ≥ τ", "timings": {"draft": 0.2}})
    err, out, now = _Recording(), _Recording(), [0.0]
    progress = Progress(1_000_000, block_line, stream=err, out=out, clock=lambda: now[0])
    for block in (0, 1, 499_999):
        now[0] += 2.0
        progress.block(SimpleNamespace(block=block, record=record))
        assert out.flushed and out.flushed[-1] == out.getvalue()  # the block's stdout line is out at once
    lines = err.getvalue().splitlines()
    assert len({len(line.split("]")[0]) for line in lines}) == 1 and max(map(len, lines)) < 100
    assert lines[-1].startswith("[" + "#" * (BAR_WIDTH // 2) + "." * (BAR_WIDTH // 2) + "] 500000/1000000")
    assert "blocks/s, 6s elapsed, ~" in lines[-1] and lines[-1].endswith("left")
    assert len(out.getvalue().splitlines()) == 3 and "block 0: accept" in out.getvalue()


def test_every_output_file_follows_the_users_umask(tiny_dir, tmp_path):
    """Video, report, timeline, latents and frames (safetensors writes 0600 itself) and make-tiny's files."""
    import os

    old = os.umask(0o027)
    try:
        outs = {"--out": "v.mp4", "--report": "r.json", "--timeline": "t.png", "--save-latents": "l.safetensors",
                "--save-frames": "f.safetensors"}
        argv = ["generate", "--prompt", "x", "--models", str(tiny_dir), "--device", "cpu", "--blocks", "1"]
        code, _out, err = run_cli(argv + [a for k, v in outs.items() for a in (k, str(tmp_path / v))])
        assert code == 0, err
        assert run_cli(["make-tiny", str(tmp_path / "tiny")])[0] == 0
    finally:
        os.umask(old)
    files = [tmp_path / v for v in outs.values()] + [p for p in (tmp_path / "tiny").rglob("*") if p.is_file()]
    assert len(files) > 8
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: "0o640" for f in files}


def test_the_disk_space_check_names_the_estimate_the_free_space_and_what_fits(tmp_path):
    from sdvg.cli.preflight import check_disk_space, estimated_mp4_bytes
    from sdvg.errors import ConfigError
    from sdvg.outputs import plan_outputs
    from sdvg.sampling import SamplerConfig

    config = SamplerConfig(num_blocks=1000, width=832, height=480, keep_output=False).validate()
    plan = plan_outputs({"video": tmp_path / "v.mp4", "latents": tmp_path / "l.safetensors"})
    mp4 = estimated_mp4_bytes(12 * 1000 - 3, 832, 480)
    assert mp4 == int(11997 * 832 * 480 * 0.3 / 8)  # 0.3 bit per pixel: about 171 MiB for 1000 blocks
    latents = 1000 * 3 * 16 * 60 * 104 * 4
    check_disk_space(plan, config, free=lambda folder: mp4 + latents)  # exactly fits: runs
    with pytest.raises(ConfigError, match=r"need about .*\(--out 171\.3 MiB \(estimated\), --save-latents 1\.1 GiB\) "
                                          r"but .* has 1\.0 GiB free; .* \(about 779 fit\)"):
        check_disk_space(plan, config, free=lambda folder: 2**30)


def test_block_lines_reach_a_pipe_while_the_run_is_still_going(tiny_dir, tmp_path):
    """stdout a pipe (a log, `| tee`): block 0's line arrives while the other 39 blocks are still being made."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "sdvg", "generate", "--prompt", "x", "--models", str(tiny_dir), "--device", "cpu",
         "--threads", "1", "--blocks", "40", "--mode", "target-only", "--out", str(tmp_path / "v.mp4")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        first = proc.stdout.readline()
        still_running = proc.poll() is None
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert first.startswith("  block 0: forced  by target") and still_running
