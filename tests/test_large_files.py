"""Large checkpoints on small machines: a header-valid, full-size (sparse) Krea 14B file is inspected from its header
alone, its load is refused before any tensor is read when it cannot fit, and loading reads one tensor at a time with
plain reads (no map of the file), giving exactly the same model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdvg import memory
from sdvg.errors import ConfigError
from sdvg.loaders.wan import build_dit_from_state_dict, inspect_dit_checkpoint, load_dit

DATA = Path(__file__).resolve().parent / "data"


def sparse_safetensors(path: Path, shapes: dict[str, list[int]], prefix: str = "model.") -> Path:
    """A valid safetensors header for ``shapes`` (bf16) and a sparse file of the full size: it costs no disk."""
    header, offset = {}, 0
    for key, shape in sorted(shapes.items()):
        n = math.prod(shape) * 2
        header[prefix + key] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little") + blob)
        fh.truncate(8 + len(blob) + offset)
    return path


@pytest.fixture(scope="module")
def krea_14b(tmp_path_factory) -> Path:
    shapes = json.loads((DATA / "wan21_t2v_key_shapes.json").read_text())["14B"]
    return sparse_safetensors(tmp_path_factory.mktemp("sparse") / "krea-realtime-video-14b.safetensors", shapes)


def test_the_sparse_14b_is_inspected_from_its_header(krea_14b):
    assert krea_14b.stat().st_size > 28e9 and krea_14b.stat().st_blocks * 512 < 50e6  # 28.6 GB, nothing on disk
    info = inspect_dit_checkpoint(krea_14b)
    assert info.size_label == "14B" and info.prefix == "model." and 14.2e9 < info.num_params < 14.4e9


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads this process's peak RSS from /proc")
def test_inspect_command_is_fast_and_small_even_with_little_address_space(krea_14b):
    """`python -m sdvg inspect` under a 3 GB address-space limit (ulimit -v): no map of the 28.6 GB file is needed.
    Its own time and memory are measured inside the process, after the imports."""
    probe = (
        "import resource, sys, time\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))\n"
        "def hwm():  # this process's own peak RSS (ru_maxrss would carry the forking parent's over exec)\n"
        "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "from sdvg.loaders.model_info import describe_model_file\n"
        "import sdvg.loaders.wan  # the imports (diffusers' modules) are not the inspection\n"
        "before = hwm()\n"
        "t = time.perf_counter(); text = describe_model_file(sys.argv[1]); dt = time.perf_counter() - t\n"
        "print(dt, hwm() - before, hwm()); print(text)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(krea_14b)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    seconds, grew, peak = (float(x) for x in out.stdout.splitlines()[0].split())
    assert seconds < 1.0 and grew < 100e6 and peak < 500e6, out.stdout
    assert "DiT 14B" in out.stdout and "57.2 GB in fp32" in out.stdout and "14.3 GB as fp8_e4m3fn" in out.stdout


def test_a_load_that_cannot_fit_is_refused_before_reading_and_says_what_would(krea_14b, monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 20e9)  # a 32 GB machine, some of it in use
    with pytest.raises(ConfigError) as caught:
        load_dit(krea_14b, dtype="bf16", device="cpu")
    message = str(caught.value)
    assert "needs about 28.6 GB on cpu, but only 20.0 GB are free" in message and "was not read" in message
    assert "As fp8_e4m3fn weights it needs about 14.3 GB (--target-dtype / --drafter-dtype fp8_e4m3fn" in message
    assert "about 15.2 GB as Q8_0 or 8.0 GB as Q4_K" in message
    assert "offload" not in message  # on the CPU the streamed blocks would stay in the same RAM


def test_the_gpu_advice_names_fp8_gguf_and_offload_with_their_sizes(krea_14b):
    from sdvg.loaders.wan import inspect_dit_checkpoint
    from sdvg.models.offload import dit_offload_plan, fit_advice

    info = inspect_dit_checkpoint(krea_14b)
    _k, _need, block = dit_offload_plan(info.config, info.num_params, 2, None, torch.device("cuda:0"))
    advice = fit_advice(info, 2, block, torch.device("cuda:0"))
    assert "--target-dtype / --drafter-dtype fp8_e4m3fn" in advice and "14.3 GB" in advice
    assert "15.2 GB as Q8_0 or 8.0 GB as Q4_K" in advice
    assert "keeps only K of its 40 blocks (0.70 GB each) on cuda:0" in advice


def test_check_fits_leaves_headroom_and_says_nothing_when_unknown():
    memory.check_fits("x", 90, torch.device("cpu"), available=100)
    with pytest.raises(ConfigError, match="needs about"):
        memory.check_fits("x", 99, torch.device("cpu"), available=100)
    memory.check_fits("x", 10**15, torch.device("meta"))  # no figure for the device: no refusal
    assert memory.free_bytes(torch.device("cpu")) > 0


def test_streaming_load_reads_no_map_and_equals_the_eager_load(tiny_dir, monkeypatch):
    import safetensors
    from safetensors.torch import load_file

    from sdvg.loaders.wan_keys import original_to_diffusers

    path = tiny_dir / "diffusion_models" / "sdvg_tiny_target.safetensors"
    eager_sd = original_to_diffusers({k.removeprefix("model."): v for k, v in load_file(str(path)).items()})
    info = inspect_dit_checkpoint(path)
    eager = build_dit_from_state_dict(eager_sd, info.config, dtype=torch.float32)

    def no_map(*args, **kwargs):
        raise AssertionError("the loader mapped the file")

    monkeypatch.setattr(safetensors, "safe_open", no_map)
    streamed = load_dit(path, dtype="fp32", device="cpu")
    ours, theirs = streamed.state_dict(), eager.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
