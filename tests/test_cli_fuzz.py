"""Property-based fuzz of the command line (hypothesis): option combinations and values drawn over every subcommand,
run through the real ``main`` in-process. Whatever is drawn, the command ends in exit code 0 or 2 with no traceback,
writes nothing outside its own temporary folder (the repository's tree and ``$HOME`` stay as they were), and
finishes in bounded time.

Values come from small pools per option: valid ones kept small (at most 2 blocks, 64×64, the toy world's models),
and the bad ones a user types (negative, zero, NaN, text for a number, empty, missing files, a folder for a file).
What keeps the long subcommands bounded is appended to every example and said here: ``train diagonal`` always runs
``--dry-run`` (its memory plan; trainings are tests/test_train_*'s), ``toy train`` always gets ``--max-steps 0``
(refused: a toy training is minutes; tests/test_toy_world.py runs it), ``bench`` always gets ``--repeats 0``
(refused; tests/test_bench.py runs it), ``eval`` always ``--limit 1 --max-rows 1 --no-videos``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sdvg.cli.commands import build_parser, main

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("SDVG_FUZZ_EXAMPLES", "100"))  # CI: about 15 s on 2 cores (300: 30 s)
EXAMPLE_SECONDS = 30.0  # the bound on one command (a valid 2-block toy generation takes about 2 s)

INTS = ["-1", "0", "1", "2", "x", ""]
FLOATS = ["-1", "0", "0.5", "nan", "inf", "-inf", "x", "1e309"]
NAMED = {
    "prompt": ["", "  ", "a red circle moving right on a black background", "x" * 2000],
    "prompt_schedule": ["0:a red circle|1:a blue square", "1:late", "0:", "x", "{t}/none.json"],
    "device": ["cpu", "auto", "meta", "cuda:9", "tpu", ""],
    "aux_device": ["cpu", "xla", ""], "text_encoder_device": ["cpu", "x"],
    "width": ["0", "16", "50", "64", "-64", "x"], "height": ["0", "16", "64", "-16"],
    "blocks": INTS, "frames": ["0", "1", "9", "21", "-3", "x"], "threads": ["0", "1", "100000", "x"],
    "schedule": ["constant", "diagonal", "1000,500", "500,750", "[oops", "[[1000,500]]", ""],
    "drafter_schedule": ["diagonal", "1000", "x"], "pattern": ["AR", "AXR", "", "A"],
    "target_lora": ["{t}/nope.safetensors", "{t}/lora.safetensors:abc", "{t}/lora.safetensors:0.5"],
    "drafter_lora": ["{t}/nope.safetensors:1"], "target_offload_blocks": ["auto", "-1", "x", "1"],
    "drafter_offload_blocks": ["auto", "0", "x"],
    "taus": ["0.1,0.2", "x", "", "nan"], "methods": ["sdvg", ",", "nope", "target-only,sdvg"],
    "metric": ["nomodule:fn", "sdvg.eval.run:temporal_flicker", "x"], "only": ["nothing", "baseline", ""],
    "levels": ["0,50", "150", "x"], "stages": ["vae", "nothing", "", "critic,vae"], "captions": ["-1", "0"],
    "data": ["toy", "{t}/none.txt"], "gpus": ["1,2", "0", "x"], "n": ["-1", "0", "1", "2"],
}
INPUT_FILES = ["{t}/nope.safetensors", "{t}/empty.pt", "{t}/page.png", "{t}/folder", "", "{toy}/vae/sdvg_toy_patch_vae"
               ".safetensors", "{toy}/diffusion_models/sdvg_toy_drafter.pt"]
INPUT_DESTS = {"models", "drafter", "target", "vae", "text_encoder", "reward", "init_image", "init_video",
               "init_latents", "v2v_video", "prompts", "files", "student", "teacher", "fake_init", "config"}
OUTPUTS = {"out": [".mp4", "", "/", ".png", ".json"], "report": [".json", ".txt"], "timeline": [".png"],
           "save_latents": [".safetensors", ".pt"], "save_frames": [".safetensors"], "json": [".json", ".txt"],
           "plot": [".png", ".mp4"], "dir": ["", "/sub"], "work": [""]}
FORCED = {("train", "diagonal"): ["--dry-run", "--out", "{t}/diag"], ("toy", "train"): ["--max-steps", "0"],
          ("bench",): ["--repeats", "0"], ("eval",): ["--limit", "1", "--max-rows", "1", "--no-videos"]}


def subcommands(parser: argparse.ArgumentParser, prefix=()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out = {}
            for name, sub in action.choices.items():
                out.update(subcommands(sub, (*prefix, name)))
            return out
    return {prefix: parser}


def pool(action: argparse.Action) -> list[str] | None:
    """The values drawn for one option, or None for a flag (present or not)."""
    dest = action.dest
    if action.nargs == 0:
        return None
    if dest in OUTPUTS:
        return [f"{{t}}/o/{dest}{suffix}" if not suffix.startswith("/") else f"{{t}}/o{suffix}" for suffix in OUTPUTS[dest]]
    if dest in NAMED:
        return NAMED[dest]
    if dest in INPUT_DESTS:
        return INPUT_FILES
    if action.choices:
        return [*map(str, action.choices), "zzz"]
    if action.type is int:
        return INTS
    if action.type is not None and action.type is not str:
        return FLOATS
    return ["", "x", "0", "-1"]


PARSERS = subcommands(build_parser())


@st.composite
def command_lines(draw) -> list[str]:
    path = draw(st.sampled_from(sorted(PARSERS)))
    actions = [a for a in PARSERS[path]._actions if a.option_strings and a.dest not in ("help", "verbose")]
    chosen = draw(st.lists(st.sampled_from(actions), max_size=4, unique_by=lambda a: a.dest)) if actions else []
    argv = list(path)
    for action in [a for a in actions if a.required] + chosen:
        values = pool(action)
        argv.append(action.option_strings[-1])
        if values is not None:
            argv.append(draw(st.sampled_from(values)))
    for action in [a for a in PARSERS[path]._actions if not a.option_strings]:  # positionals (files, dir)
        argv.append(draw(st.sampled_from(pool(action) or [""])))
    return argv + FORCED.get(path, [])


# the valid lane: generate with options drawn from valid values only (toy models, 64×64, 1-2 blocks), so the
# success paths are fuzzed too; combinations that are still refused (e.g. a pattern of the wrong length) end in 2
VALID = {
    "--blocks": ["1", "2"], "--seed": ["0", "7"], "--cache": ["recompute", "global", "noisy"],
    "--positions": ["absolute", "window"], "--schedule": ["constant", "diagonal", "1000,500"],
    "--step-noise": ["fresh", "predicted"], "--mode": ["reward", "target-only", "draft-only", "random"],
    "--aggregation": ["min", "mean", "quantile"], "--threshold": ["fixed", "relative"], "--tau": ["0.3", "-inf", "inf"],
    "--refine-from-step": ["1"], "--cascade": ["0", "4"], "--first-frame": ["reencode", "latent"],
    "--report": ["{t}/o/r.json"], "--timeline": ["{t}/o/t.png"], "--save-latents": ["{t}/o/l.safetensors"],
    "--frames": ["9", "12"], "--window": ["12"], "--sinks": ["0", "3"],
}
FLAGS = ["--pipelined", "--no-force-reject-first", "--early-exit", "--stitch"]


@st.composite
def valid_generate_lines(draw) -> list[str]:
    argv = ["generate", "--prompt", "a red circle moving right on a black background", "--threads", "1",
            "--device", "cpu", "--out", "{t}/o/v.mp4"]
    options = draw(st.lists(st.sampled_from(sorted(VALID)), max_size=5, unique=True))
    if "--frames" in options and "--blocks" in options:
        options.remove("--frames")
    for option in options:
        argv += [option, draw(st.sampled_from(VALID[option]))]
    return argv + draw(st.lists(st.sampled_from(FLAGS), max_size=2, unique=True))


def tree_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    t = tmp_path_factory.mktemp("fuzz")
    (t / "empty.pt").write_bytes(b"")
    (t / "page.png").write_text("<html></html>")
    (t / "folder").mkdir()
    (t / "lora.safetensors").write_bytes(b"")
    (t / "home").mkdir()
    return t


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(argv=command_lines())
def test_any_command_line_ends_in_0_or_2_without_a_traceback_or_a_stray_file(place, monkeypatch, argv):
    check_command(place, monkeypatch, argv)


@settings(FUZZ, max_examples=max(1, EXAMPLES // 12))  # about 1.5 s each: 8 runs of the toy models
@given(argv=valid_generate_lines())
def test_valid_generate_lines_run_and_end_in_0_or_2(place, monkeypatch, argv):
    assert check_command(place, monkeypatch, argv) in (0, 2)


def check_command(place, monkeypatch, argv: list[str]) -> int:
    """Run one command line; assert the guarantees; return its exit code."""
    from sdvg.toy import toy_tree

    monkeypatch.chdir(place)  # relative outputs land here
    monkeypatch.setenv("HOME", str(place / "home"))  # caches (~/.cache/sdvg) too
    monkeypatch.setenv("SDVG_CACHE_DIR", str(place / "home" / "cache"))
    argv = [a.format(t=place, toy=toy_tree()) for a in argv]
    before, err = tree_state(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's refusals (2) and --help (0)
            code = exc.code
    elapsed = time.perf_counter() - start
    text = err.getvalue()
    event(f"{argv[0]} exit {code}")  # pytest --hypothesis-show-statistics: how many ran and how many were refused
    assert code in (0, 2), (argv, code, text[-2000:])
    assert "Traceback" not in text, (argv, text[-2000:])
    assert tree_state() == before, (argv, "wrote into the repository")
    assert elapsed < EXAMPLE_SECONDS, (argv, elapsed)
    return code
