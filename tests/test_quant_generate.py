"""`generate` end to end on tiny GGUF and scaled-fp8 target and drafter files, and per-role dtypes."""

from __future__ import annotations

import json

import pytest
import torch

from sdvg.cli.commands import main
from sdvg.fixtures.quant_files import write_fp8_scaled_dit, write_gguf_dit
from sdvg.fixtures.tiny import TINY_DRAFTER_CONFIG, TINY_TARGET_CONFIG, random_original_state_dict
from sdvg.loaders.bundle import load_models
from sdvg.models.quant import quant_summary
from sdvg.outputs import read_video_frames

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def quant_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-dits")
    t_sd = random_original_state_dict(TINY_TARGET_CONFIG, seed=4321)
    d_sd = random_original_state_dict(TINY_DRAFTER_CONFIG, seed=1235)
    th, dh = TINY_TARGET_CONFIG["num_attention_heads"], TINY_DRAFTER_CONFIG["num_attention_heads"]
    files = {"gguf_target": root / "target-Q4_K_M.gguf", "gguf_drafter": root / "drafter-Q8_0.gguf"}
    write_gguf_dit(files["gguf_target"], t_sd, qtype="Q4_K", types={"blocks.1.ffn.2.weight": "Q6_K"}, num_heads=th)
    write_gguf_dit(files["gguf_drafter"], d_sd, qtype="Q8_0", num_heads=dh)
    files["fp8_target"] = write_fp8_scaled_dit(root / "target_fp8_scaled.safetensors", t_sd, num_heads=th)
    files["fp8_drafter"] = write_fp8_scaled_dit(root / "drafter_fp8_scaled.safetensors", d_sd, layout="weight_scale",
                                                num_heads=dh)
    return files


@pytest.mark.parametrize("kind", ["gguf", "fp8"])
def test_generate_runs_end_to_end_on_quantized_target_and_drafter(tiny_dir, quant_files, tmp_path, kind):
    out, report = tmp_path / "v.mp4", tmp_path / "r.json"
    code = main([
        "generate", "--prompt", "a red circle", "--models", str(tiny_dir), "--device", "cpu", "--blocks", "3",
        "--target", str(quant_files[f"{kind}_target"]), "--drafter", str(quant_files[f"{kind}_drafter"]),
        "--tau=-inf", "--cache", "global", "--seed", "3", "--target-offload-blocks", "1",
        "--out", str(out), "--report", str(report),
    ])
    assert code == 0
    assert len(read_video_frames(out)) == 33
    blocks = json.loads(report.read_text())["blocks"]
    assert [b["produced_by"] for b in blocks] == ["target", "drafter", "drafter"]
    assert all(b.get("score") is None or b["score"] == b["score"] for b in blocks)


def test_per_role_dtypes_reach_each_dit(tiny_dir, quant_files):
    models = load_models(tiny_dir, target=quant_files["gguf_target"], need=("target", "drafter", "vae"), dit_device="cpu",
                         dtype="fp32", dtypes={"target": "bf16"})
    assert models.target.compute_dtype == torch.bfloat16 and models.drafter.compute_dtype == torch.float32
    assert quant_summary(models.target)["Q4_K"] > 0 and not quant_summary(models.drafter)


def test_cli_role_dtype_flags_parse_and_default_to_dtype():
    from sdvg.cli.commands import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--out", "v.mp4", "--dtype", "bf16",
                                       "--target-dtype", "fp8_e4m3fn"])
    assert (args.dtype, args.target_dtype, args.drafter_dtype) == ("bf16", "fp8_e4m3fn", None)
