"""The pack inside a real ComfyUI (``main.py --cpu``), opt-in:

    SDVG_COMFYUI_DIR=/work/comfyui SDVG_COMFYUI_PYTHON=/work/comfy-venv/bin/python .venv/bin/python -m pytest -q tests/test_host_comfyui.py

Skipped when those variables are unset (CI). The server loads the pack through extra_model_paths.yaml from
outside the ComfyUI tree, with the tiny models made by ``python -m sdvg make-tiny``.
"""

from __future__ import annotations

import copy
import json
import os
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.host import build_workflows, comfy_server
from tests.host.core_nodes import CORE_NODES
from tests.host.faulty_models import write_nan_target
from tests.host.schema_checks import node_problems, widget_inputs

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.host, pytest.mark.skipif(not comfy_server.host_configs(), reason=comfy_server.SKIP_REASON)]
HOSTS = comfy_server.host_configs()
OUR_NODES = {"SDVGModelLoader", "SDVGTextEncoderLoader", "SDVGVAELoader", "SDVGRewardLoader", "SDVGTextEncode",
             "SDVGPromptSchedule", "SDVGStartFrames", "SDVGRewardRouter", "SDVGSpeculativeSampler", "SDVGReport"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    from sdvg.fixtures.tiny import make_tiny

    root = tmp_path_factory.mktemp("models")
    make_tiny(root)
    # a corrupt DiT for the error test
    (root / "diffusion_models").mkdir(exist_ok=True)
    (root / "diffusion_models" / "sdvg_corrupt.safetensors").write_bytes(b"\x00not a safetensors file" * 4)
    # a valid DiT that cannot pair with the tiny drafter: its text embedding width differs
    from safetensors.torch import save_file

    from sdvg.fixtures.tiny import TINY_TARGET_CONFIG, TINY_TEXT_DIM, random_original_state_dict
    from sdvg.loaders.wan_keys import META_NUM_HEADS

    config = dict(TINY_TARGET_CONFIG, text_dim=TINY_TEXT_DIM * 2)
    save_file({"model." + k: v for k, v in random_original_state_dict(config, seed=99).items()},
              str(root / "diffusion_models" / "sdvg_other_text_dim.safetensors"),
              metadata={META_NUM_HEADS: str(config["num_attention_heads"])})
    write_nan_target(root)  # a target whose output head is NaN: a fault in the middle of a run
    # a DiT core's Load Diffusion Model detects (unprefixed original keys, head dim 128, freq dim 256, text dim 4096)
    # and a text encoder as wide as its text embedding
    from sdvg.fixtures.tiny import write_tiny_text_encoder
    from sdvg.loaders.wan_keys import make_config

    core_cfg = make_config(4, 128, 16, 16, 4096, 256, 256, 2, (1, 2, 2))
    save_file(random_original_state_dict(core_cfg, seed=77), str(root / "diffusion_models" / "sdvg_core_wan.safetensors"))
    write_tiny_text_encoder(root, d_model=4096, filename="sdvg_tiny_umt5_4096.safetensors")
    from sdvg.fixtures.loras import lora_factors, write_lora

    write_lora(root / "loras" / "sdvg_core_wan_lora.safetensors", lora_factors(core_cfg, seed=3), "original")
    return root


@pytest.fixture(scope="module", params=HOSTS or [None], ids=[label for label, _t, _p in HOSTS] or ["none"])
def server(request, models_dir):
    """One real ComfyUI per configured host (each version in turn)."""
    _label, tree, python = request.param
    srv = comfy_server.ComfyServer(models_dir, host=(tree, python)).start()
    yield srv
    srv.stop()


def _free(server, body: dict, predicate, timeout: float = 30.0) -> dict:
    """POST /free and wait until ``predicate(GET /sdvg/models)``. The flag is posted again every 2 s: ComfyUI's prompt
    worker misses the wake-up of a flag set while it is busy (garbage collection after a prompt) and would then
    sleep up to 1000 s before reading it."""
    deadline = time.time() + timeout
    while True:
        server.post("/free", body)
        for _ in range(10):
            state = server.get("/sdvg/models")
            if predicate(state) or time.time() > deadline:
                return state
            time.sleep(0.2)


def tiny_prompt(**sampler_overrides) -> dict:
    prompt = json.loads((REPO / "tests" / "workflows" / "sdvg_tiny_cpu.api.json").read_text(encoding="utf-8"))
    sampler = next(k for k, n in prompt.items() if n["class_type"] == "SDVGSpeculativeSampler")
    prompt[sampler]["inputs"].update(sampler_overrides)
    return prompt


def sampler_id(prompt: dict) -> str:
    return next(k for k, n in prompt.items() if n["class_type"] == "SDVGSpeculativeSampler")


def test_nodes_registered_with_valid_schemas(server):
    info = server.get("/object_info")
    assert OUR_NODES <= set(info)
    problems = []
    for name in sorted(OUR_NODES):
        problems += node_problems(name, info[name])
        assert info[name]["python_module"].startswith("custom_nodes.")
    assert not problems, "\n".join(problems)
    assert info["SDVGRewardRouter"]["input"]["required"]["tau"][1]["display"] == "slider"
    spec = info["SDVGRewardLoader"]["input"]["required"]["model_name"]
    reward_files = spec[0] if isinstance(spec[0], list) else spec[1]["options"]
    # vocab.txt beside it is not offered; the pack's toy-world critic is (its folder is added after the user's)
    assert reward_files == ["sdvg_tiny_image_reward.pt", "sdvg_toy_critic.pt"]


def test_core_node_table_matches_the_host(server):
    info = server.get("/object_info")
    for name, ours in CORE_NODES.items():
        real = info[name]
        mine, theirs = [w[0] for w in widget_inputs(ours)], [w[0] for w in widget_inputs(real)]
        # a newer host may append optional widgets (v0.27's CreateVideo: bit_depth); the shipped workflows still run
        assert theirs[: len(mine)] == mine, name
        assert all(w in real["input"].get("optional", {}) for w in theirs[len(mine):]), (name, theirs[len(mine):])
        for key, _t, opts in widget_inputs(ours):
            real_spec = real["input"].get("required", {}).get(key) or real["input"]["optional"][key]
            if "options" in opts and opts["options"]:
                real_opts = real_spec[0] if isinstance(real_spec[0], list) else real_spec[1].get("options")
                assert set(opts["options"]) <= set(real_opts), (name, key)
        assert real["output"][: len(ours["output"])] == ours["output"], name  # (v0.27's SaveVideo also outputs VIDEO)


def test_workflows_are_listed_as_templates(server):
    templates = server.get("/workflow_templates")
    assert sorted(templates["sdvg"]) == sorted(p.stem for p in (REPO / "workflows").glob("*.json"))
    tiny = urllib.parse.quote(build_workflows.ui_path("sdvg_tiny_cpu").stem)  # a readable title: spaces and all
    with urllib.request.urlopen(f"{server.base}/api/workflow_templates/sdvg/{tiny}.json") as r:
        assert json.loads(r.read())["nodes"]
    with urllib.request.urlopen(f"{server.base}/api/workflow_templates/sdvg/{tiny}.jpg") as r:
        assert r.read(3) == b"\xff\xd8\xff"


def test_web_extension_and_help_pages_are_served(server):
    assert "/extensions/sdvg/js/sdvg_timeline.js" in server.get("/extensions")
    for name in OUR_NODES:
        with urllib.request.urlopen(f"{server.base}/extensions/sdvg/docs/{name}.md") as r:
            assert r.read().startswith(b"#")


def test_tiny_workflow_streams_blocks_and_saves_a_video(server, models_dir):
    prompt = tiny_prompt()
    node = sampler_id(prompt)
    blocks = prompt[node]["inputs"]["blocks"]
    log = server.run(prompt)
    types = log.types()
    assert "execution_success" in types, server.server_log()[-3000:]
    events = log.of("sdvg.block")
    assert [e["block"] for e in events] == list(range(blocks))
    assert all(e["node"] == node and e["decision"] for e in events)
    assert events[0]["produced_by"] == "target" and events[0]["kind"] == "forced" and not events[0]["drafted"]
    for e in events:
        assert e["kind"] == ("accept" if e["produced_by"] == "drafter" else "reject" if e["drafted"] else "forced")
    assert [a["block"] for a in log.of("sdvg.preview")] == list(range(blocks))
    previews = [p for p in log.previews() if p["node_id"] == node]
    assert len(previews) == blocks and all(p["image_type"] == "image/jpeg" and p["bytes"] > 100 for p in previews)
    assert [p["display_node_id"] for p in previews] == [node] * blocks
    assert len(log.of("sdvg.start")) == 1 and len(log.of("sdvg.done")) == 1
    saved = [o for o in log.of("executed") if o["output"] and "images" in o["output"] and o["output"].get("animated")]
    files = [Path(server.tmp) / "out" / i["subfolder"] / i["filename"] for o in saved for i in o["output"]["images"]]
    assert files and all(f.suffix == ".mp4" and f.stat().st_size > 0 for f in files), log.of("executed")


def test_toy_workflow_runs_as_shipped_and_its_video_shows_the_caption(server):
    """The toy CPU workflow needs no model files of the user's (the pack adds its toy models to ComfyUI's folders);
    its saved video is read back and judged against its caption."""
    from sdvg.outputs.video import read_video_frames
    from sdvg.toy.judge import judge

    prompt = json.loads((REPO / "tests" / "workflows" / "sdvg_toy_cpu.api.json").read_text(encoding="utf-8"))
    log = server.run(prompt)
    assert "execution_success" in log.types(), server.server_log()[-3000:]
    events = log.of("sdvg.block")
    assert len(events) == prompt[sampler_id(prompt)]["inputs"]["blocks"] and events[0]["produced_by"] == "target"
    saved = [o for o in log.of("executed") if o["output"] and "images" in o["output"] and o["output"].get("animated")]
    video = [Path(server.tmp) / "out" / i["subfolder"] / i["filename"] for o in saved for i in o["output"]["images"]][0]
    caption = next(n["inputs"]["prompt"] for n in prompt.values() if n["class_type"] == "SDVGTextEncode")
    verdict = judge(read_video_frames(video), caption)
    assert verdict.valid, verdict  # a picture of the world (an object on its background), not noise


def test_cancel_stops_within_a_step_and_the_server_stays_up(server, models_dir):
    prompt = tiny_prompt(blocks=40, seed=5)
    started = {}

    def after_first_block(log):
        if log.of("sdvg.block") and "t" not in started:
            started["t"] = time.time()
            return True
        return False

    log = server.run(prompt, interrupt_when=after_first_block)
    types = log.types()
    assert "execution_interrupted" in types and "execution_success" not in types
    assert len(log.of("sdvg.block")) < 40
    assert server.alive()
    # the next prompt runs normally
    assert "execution_success" in server.run(tiny_prompt(blocks=1, seed=6)).types()


def test_cancel_with_keep_finished_blocks_saves_them_and_the_prompt_completes(server, models_dir):
    prompt = tiny_prompt(blocks=40, seed=5, on_cancel="keep finished blocks")
    log = server.run(prompt, interrupt_when=lambda log: bool(log.of("sdvg.block")))
    types = log.types()
    assert "execution_success" in types and "execution_interrupted" not in types, types
    finished = len(log.of("sdvg.block"))
    assert 1 <= finished < 40
    saved = [o for o in log.of("executed") if o["output"] and "images" in o["output"] and o["output"].get("animated")]
    files = [Path(server.tmp) / "out" / i["subfolder"] / i["filename"] for o in saved for i in o["output"]["images"]]
    from sdvg.outputs import read_video_frames

    assert files and len(read_video_frames(files[-1])) == 12 * finished - 3  # exactly the finished blocks, saved
    assert server.alive()


def test_corrupt_model_gives_execution_error_and_server_stays_up(server, models_dir):
    prompt = copy.deepcopy(tiny_prompt())
    loader = next(k for k, n in prompt.items() if n["class_type"] == "SDVGModelLoader")
    prompt[loader]["inputs"]["model_name"] = "sdvg_corrupt.safetensors"
    log = server.run(prompt)
    errors = log.of("execution_error")
    assert errors and errors[0]["node_type"] == "SDVGModelLoader"
    assert errors[0]["exception_type"].endswith("ModelFileError"), errors[0]
    assert "sdvg_corrupt.safetensors" in errors[0]["exception_message"]
    assert server.alive()


def _sampler_error_with_target(server, model_name: str):
    """Run the tiny workflow with another target file; the sampler's execution_error and the run's log."""
    prompt = tiny_prompt()
    target_loader = prompt[sampler_id(prompt)]["inputs"]["target"][0]
    prompt[target_loader]["inputs"]["model_name"] = model_name
    log = server.run(prompt)
    errors = log.of("execution_error")
    assert errors and errors[0]["node_type"] == "SDVGSpeculativeSampler", log.types()
    return errors[0], log


def test_mismatched_drafter_and_target_is_a_node_error(server):
    error, log = _sampler_error_with_target(server, "sdvg_other_text_dim.safetensors")
    assert error["exception_type"].endswith("ConfigError") and "text_dim" in error["exception_message"]
    assert not log.of("sdvg.block") and server.alive()


def test_a_target_that_produces_nan_is_an_execution_error_naming_it_and_the_server_stays_up(server):
    error, _log = _sampler_error_with_target(server, "sdvg_nan_target.safetensors")
    assert error["exception_type"].endswith("RunFailed")
    assert "The target produced NaN/inf latents in block 0" in error["exception_message"]
    assert server.alive() and "execution_success" in server.run(tiny_prompt()).types()  # and the next run works


def test_a_fault_in_block_3_saves_the_3_finished_blocks_and_shows_the_error_on_the_node(server):
    """on_fault keep finished blocks (the default): pattern AAAR without a forced block 0 sends block 3 to the NaN
    target; the node outputs blocks 0-2, SaveVideo saves them, and the error reaches the node's timeline."""
    from sdvg.outputs import read_video_frames

    prompt = tiny_prompt(blocks=4)
    node = sampler_id(prompt)
    prompt[prompt[node]["inputs"]["target"][0]]["inputs"]["model_name"] = "sdvg_nan_target.safetensors"
    prompt[prompt[node]["inputs"]["router"][0]]["inputs"].update(mode="pattern", pattern="AAAR",
                                                                  force_reject_first=False)
    log = server.run(prompt)
    assert "execution_success" in log.types() and not log.of("execution_error"), server.server_log()[-3000:]
    assert [e["block"] for e in log.of("sdvg.block")] == [0, 1, 2]
    (done,) = log.of("sdvg.done")
    assert "The target produced NaN/inf latents in block 3" in done["fault"]
    ours = [o for o in log.of("executed") if o["node"] == node]
    assert ours and "block 3" in ours[0]["output"]["sdvg_timeline"][0]["fault"]
    saved = [o for o in log.of("executed") if o["output"] and "images" in o["output"] and o["output"].get("animated")]
    files = [Path(server.tmp) / "out" / i["subfolder"] / i["filename"] for o in saved for i in o["output"]["images"]]
    assert files and len(read_video_frames(files[-1])) == 12 * 3 - 3  # the 3 finished blocks, saved
    assert server.alive()


def test_bad_sampler_settings_are_refused_at_queue_time_before_any_node_runs(server):
    """The sampler's validate_inputs: POST /prompt answers 400 naming the problem, and nothing executes (no model
    loads)."""
    import urllib.error

    prompt = tiny_prompt(width=60)
    node = sampler_id(prompt)
    with pytest.raises(urllib.error.HTTPError) as caught:
        server.post("/prompt", {"prompt": prompt, "client_id": "queue-time-check"})
    body = json.loads(caught.value.read())
    assert caught.value.code == 400
    details = " ".join(e["details"] for e in body["node_errors"][node]["errors"])
    assert "multiples of 16" in details
    assert server.get("/queue")["queue_running"] == [] and server.alive()


def test_unload_models_evicts_ours_free_memory_drops_them_and_the_next_run_reloads_them(server):
    kinds = {"dit", "vae", "text_encoder", "reward"}
    assert "execution_success" in server.run(tiny_prompt(seed=101)).types(), server.server_log()[-3000:]
    loaded = server.get("/sdvg/models")
    assert {m["kind"] for m in loaded["models"]} == kinds and len(loaded["models"]) == 5
    assert all(m["comfy_loaded"] and m["bytes"] > 0 for m in loaded["models"]), loaded
    # Unload Models: ComfyUI evicts ours as its own (they stay in its node cache, off its loaded list)
    evicted = _free(server, {"unload_models": True}, lambda s: not any(m["comfy_loaded"] for m in s["models"]))
    assert len(evicted["models"]) == 5 and not any(m["comfy_loaded"] for m in evicted["models"]), evicted
    # the next run brings them back through ComfyUI, without reading the files again
    assert "execution_success" in server.run(tiny_prompt(seed=102)).types()
    back = server.get("/sdvg/models")
    assert len(back["models"]) == 5, back
    # the sampler's models are back; the text encoder stays off (its node was cached: nothing was encoded)
    assert {m["kind"]: m["comfy_loaded"] for m in back["models"]} == {"dit": True, "vae": True, "reward": True,
                                                                     "text_encoder": False}, back
    # Free model and node cache: the cached node outputs go, and our models with them
    freed = _free(server, {"unload_models": True, "free_memory": True}, lambda s: not s["models"])
    assert freed["models"] == [], freed
    assert "execution_success" in server.run(tiny_prompt(seed=103)).types()
    assert len(server.get("/sdvg/models")["models"]) == 5


def _core_wan_prompt(target: dict, prefix: str) -> dict:
    """Target-only tiny run whose target comes from ``target`` (extra nodes, the last one's output 0), saving the latents."""
    prompt = {k: v for k, v in tiny_prompt(seed=5, blocks=2).items() if v["class_type"].startswith("SDVG")
              and v["class_type"] != "SDVGReport"}
    node = sampler_id(prompt)
    te = next(k for k, n in prompt.items() if n["class_type"] == "SDVGTextEncoderLoader")
    prompt[te]["inputs"]["model_name"] = "sdvg_tiny_umt5_4096.safetensors"
    router = next(k for k, n in prompt.items() if n["class_type"] == "SDVGRewardRouter")
    prompt[router]["inputs"]["mode"] = "target-only"
    prompt[node]["inputs"].pop("drafter")
    prompt.update(target)
    prompt[node]["inputs"]["target"] = [sorted(target, key=int)[-1], 0]
    prompt["40"] = {"class_type": "SaveLatent", "inputs": {"samples": [node, 1], "filename_prefix": f"latents/{prefix}"}}
    return prompt


def _latents(server, target: dict, name: str):
    """The saved latents of a target-only tiny run whose target comes from the ``target`` nodes."""
    from safetensors.torch import load_file

    log = server.run(_core_wan_prompt(target, name))
    assert "execution_success" in log.types(), (log.of("execution_error"), server.server_log()[-3000:])
    (path,) = (Path(server.tmp) / "out" / "latents").glob(f"{name}_*.latent")
    return load_file(str(path))["latent_tensor"]


CORE_WAN_FILE = {"30": {"class_type": "SDVGModelLoader", "inputs": {"model_name": "sdvg_core_wan.safetensors",
                                                                    "weight_dtype": "fp32", "device": "cpu",
                                                                    "offload": "keep_loaded"}}}


def test_a_core_model_from_load_diffusion_model_runs_as_our_target_bit_for_bit(server):
    ours = CORE_WAN_FILE
    core = {"30": {"class_type": "UNETLoader", "inputs": {"unet_name": "sdvg_core_wan.safetensors",
                                                          "weight_dtype": "default"}},
            "31": {"class_type": "SDVGDiTFromModel", "inputs": {"model": ["30", 0], "weight_dtype": "fp32",
                                                                "device": "cpu", "offload": "keep_loaded"}}}
    latents = {name: _latents(server, target, f"sdvg_core_{name}") for name, target in (("file", ours), ("core", core))}
    assert latents["file"].shape[2] == 6 and latents["file"].abs().sum() > 0
    assert torch.equal(latents["file"], latents["core"])


def test_our_lora_merge_matches_comfyuis_own_lora_on_the_same_file(server):
    """SDVG Load LoRA (merged as the file is read) against core's LoraLoaderModelOnly → SDVG DiT from MODEL (ComfyUI's
    calculate_weight): two implementations of the same merge give the same video up to fp32 rounding."""
    lora = {"lora_name": "sdvg_core_wan_lora.safetensors"}
    ours = {"30": {"class_type": "SDVGModelLoader", "inputs": {"model_name": "sdvg_core_wan.safetensors",
                                                               "weight_dtype": "fp32", "device": "cpu",
                                                               "offload": "keep_loaded"}},
            "31": {"class_type": "SDVGLoraLoader", "inputs": {"dit": ["30", 0], **lora, "strength": 0.7}}}
    core = {"30": {"class_type": "UNETLoader", "inputs": {"unet_name": "sdvg_core_wan.safetensors",
                                                          "weight_dtype": "default"}},
            "31": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["30", 0], **lora, "strength_model": 0.7}},
            "32": {"class_type": "SDVGDiTFromModel", "inputs": {"model": ["31", 0], "weight_dtype": "fp32",
                                                                "device": "cpu", "offload": "keep_loaded"}}}
    latents = {name: _latents(server, target, f"sdvg_lora_{name}")
               for name, target in (("plain", CORE_WAN_FILE), ("ours", ours), ("core", core))}
    assert not torch.allclose(latents["ours"], latents["plain"], atol=1e-3)  # the LoRA acts
    assert torch.allclose(latents["ours"], latents["core"], atol=1e-4, rtol=0)


def test_server_log_has_no_pack_import_error(server):
    text = server.server_log()
    assert "IMPORT FAILED" not in "\n".join(line for line in text.splitlines() if "sdvg" in line)
    assert os.path.basename(str(server.tmp))
