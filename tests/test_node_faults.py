"""A fault in the middle of a sampler node's run (stub host): with ``on_fault: keep finished blocks`` (the default)
the node outputs the blocks finished before it, the report says partial and names the fault, and the error reaches
the node (its ``sdvg.done`` event and ui timeline); with ``stop`` the prompt fails as any node error does. The real
hosts: tests/test_host_comfyui.py. And an empty prompt, refused by SDVG Text Encode."""

from __future__ import annotations

import json

import pytest

from tests.host.faulty_models import NAN_TARGET, write_nan_target
from tests.test_nodes import tiny_host, tiny_nodes, tiny_root  # noqa: F401 - fixtures


def _run_with_nan_target_at_block_3(nodes, root, **sampler_kwargs):
    """Pattern routing AAAR without a forced block 0: blocks 0-2 are drafted and kept, block 3 is rejected and
    goes to the NaN target."""
    from tests.host import stub

    write_nan_target(root)
    load = nodes["SDVGModelLoader"].execute
    drafter = load(model_name="sdvg_tiny_drafter.pt", weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    target = load(model_name=NAN_TARGET, weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    vae = nodes["SDVGVAELoader"].execute(model_name="sdvg_tiny_vae.safetensors", device="cpu", dtype="fp32")[0]
    te = nodes["SDVGTextEncoderLoader"].execute(model_name="sdvg_tiny_umt5.safetensors", device="cpu", dtype="fp32")[0]
    cond = nodes["SDVGTextEncode"].execute(prompt="a red fox in the snow", text_encoder=te)[0]
    router = nodes["SDVGRewardRouter"].execute(tau=-0.7, aggregation="min", quantile=0.1, threshold_mode="fixed",
                                               target_rate=0.72, delta=0.5, mode="pattern", random_rate=0.5,
                                               force_reject_first=False, early_exit=False, pattern="AAAR")[0]
    sampler = nodes["SDVGSpeculativeSampler"]
    sampler.hidden = stub.HiddenHolder(unique_id="7")
    return sampler.execute(vae=vae, conditioning=cond, router=router, drafter=drafter, target=target, seed=1, blocks=4,
                           width=64, height=64, cache="recompute", schedule="constant",
                           custom_schedule="1000,750,500,250", pipelined=False, refine_from_step=0, **sampler_kwargs)


def test_a_fault_in_block_3_outputs_blocks_0_to_2_with_the_error_on_the_node(tiny_host, tiny_nodes, tiny_root):  # noqa: F811
    out = _run_with_nan_target_at_block_3(tiny_nodes, tiny_root)
    images, latent, report = out.args
    data = json.loads(report)
    assert data["partial"] is True and [b["block"] for b in data["blocks"]] == [0, 1, 2]
    assert "The target produced NaN/inf latents in block 3" in data["fault"]
    assert images.shape[0] == 12 * 3 - 3 and latent["samples"].shape[2] == 9
    (done,) = tiny_host.events_of("sdvg.done")
    assert "block 3" in done["fault"]
    assert "block 3" in out.ui["sdvg_timeline"][0]["fault"]  # the timeline on the node shows it


def test_a_fault_with_on_fault_stop_fails_the_prompt(tiny_host, tiny_nodes, tiny_root):  # noqa: F811
    from sdvg_pack_under_test.sdvg.errors import RunFailed

    with pytest.raises(RunFailed, match="NaN/inf latents in block 3"):
        _run_with_nan_target_at_block_3(tiny_nodes, tiny_root, on_fault="stop")


def test_an_empty_prompt_is_refused_by_text_encode(tiny_host, tiny_nodes):  # noqa: F811
    from sdvg_pack_under_test.sdvg.errors import ConfigError

    te = tiny_nodes["SDVGTextEncoderLoader"].execute(model_name="sdvg_tiny_umt5.safetensors", device="cpu",
                                                     dtype="fp32")[0]
    with pytest.raises(ConfigError, match="SDVG Text Encode's prompt is empty; describe the video"):
        tiny_nodes["SDVGTextEncode"].execute(prompt=" \n ", text_encoder=te)
