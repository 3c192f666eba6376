"""The ComfyUI nodes against a stub host (no ComfyUI needed): schemas, execution on the tiny models, events,
previews, cancel, errors. The stub modules are removed after each test."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.host import pack, stub
from tests.host.schema_checks import node_problems


def _stub_host_with_pack(models, *, image_reward_folder=None):
    """Install the stub host over ``models``, load the pack, and undo both afterwards."""
    h = stub.install(models)
    if image_reward_folder is not None:
        import folder_paths

        folder_paths.folder_names_and_paths["image_reward"] = ([str(image_reward_folder)], set())
    try:
        pack.load_pack()
        yield h
    finally:
        pack.unload_pack()
        stub.uninstall()


@pytest.fixture()
def host(tmp_path):
    yield from _stub_host_with_pack(tmp_path / "models")


@pytest.fixture()
def nodes(host):
    mod = pack.submodule("nodes")
    return {cls.define_schema().node_id: cls for cls in mod.node_classes()}


def test_entrypoint_lists_every_node(host):
    mod = pack.load_pack()
    ext = asyncio.run(mod.comfy_entrypoint())
    classes = asyncio.run(ext.get_node_list())
    ids = [c.define_schema().node_id for c in classes]
    assert ids == [
        "SDVGModelLoader", "SDVGLoraLoader", "SDVGTextEncoderLoader", "SDVGVAELoader", "SDVGRewardLoader",
        "SDVGDiTFromModel",
        "SDVGTextEncode", "SDVGPromptSchedule", "SDVGStartFrames", "SDVGRewardRouter", "SDVGSpeculativeSampler",
        "SDVGReport",
    ]
    assert not hasattr(mod, "NODE_CLASS_MAPPINGS")


def test_entrypoint_adds_the_toy_models_after_the_users_folders(host):
    """The committed toy-world models appear in ComfyUI's model lists (the toy CPU workflow runs as shipped), after the
    user's own folders, with models/image_reward still registered first."""
    import folder_paths

    asyncio.run(pack.load_pack().comfy_entrypoint())
    for folder, name in (("diffusion_models", "sdvg_toy_target.safetensors"), ("vae", "sdvg_toy_patch_vae.safetensors"),
                         ("text_encoders", "sdvg_toy_umt5.safetensors"), ("image_reward", "sdvg_toy_critic.pt")):
        paths = folder_paths.get_folder_paths(folder)
        assert paths[0] == str(host.models_dir / folder), paths
        assert paths[-1].replace("\\", "/").endswith(f"sdvg/toy/models/{folder}")
        assert name in folder_paths.get_filename_list(folder)


def test_schemas_are_valid(nodes):
    problems = []
    for name, cls in nodes.items():
        problems += node_problems(name, stub.node_info(cls))
    assert not problems, "\n".join(problems)


def test_router_slider_and_sampler_widgets(nodes):
    router = stub.node_info(nodes["SDVGRewardRouter"])["input"]["required"]
    want = {"default": -0.7, "min": -5.0, "max": 3.0, "step": 0.05, "display": "slider"}
    assert {k: router["tau"][1].get(k) for k in want} == want
    assert router["aggregation"][0][0] == "min"
    sampler = stub.node_info(nodes["SDVGSpeculativeSampler"])["input"]
    assert sampler["required"]["seed"][1]["control_after_generate"] is True
    assert sampler["required"]["width"][1]["step"] == 16 and sampler["required"]["height"][1]["step"] == 16
    assert set(sampler["optional"]) == {"drafter", "target", "reward", "start", "on_fault", "drafter_schedule",
                                        "drafter_step_noise"}
    assert sampler["hidden"]["unique_id"] == ["UNIQUE_ID"]


def test_device_lists_are_built_at_schema_time(nodes, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    info = stub.node_info(nodes["SDVGModelLoader"])
    assert info["input"]["required"]["device"][0] == ["auto", "cpu", "cuda:0", "cuda:1"]


def test_image_reward_folder_registered_once_and_respects_existing(host, nodes, tmp_path):
    import folder_paths

    nodes["SDVGRewardLoader"].define_schema()
    nodes["SDVGRewardLoader"].define_schema()
    assert folder_paths.get_folder_paths("image_reward") == [str(host.models_dir / "image_reward")]
    # a folder already mapped (extra_model_paths.yaml) is kept, not replaced
    folder_paths.folder_names_and_paths["image_reward"] = ([str(tmp_path / "elsewhere")], set())
    nodes["SDVGRewardLoader"].define_schema()
    assert folder_paths.get_folder_paths("image_reward") == [str(tmp_path / "elsewhere")]


def test_reward_file_list_hides_vocab(host, nodes):
    folder = host.models_dir / "image_reward"
    folder.mkdir(parents=True)
    (folder / "ImageReward.pt").write_bytes(b"x")
    (folder / "vocab.txt").write_text("[PAD]\n")
    info = stub.node_info(nodes["SDVGRewardLoader"])
    assert info["input"]["required"]["model_name"][0] == ["ImageReward.pt"]


def test_missing_model_file_names_the_folder(nodes):
    from sdvg_pack_under_test.sdvg.errors import ModelFileError

    with pytest.raises(ModelFileError, match="diffusion_models"):
        nodes["SDVGModelLoader"].execute(model_name="nope.safetensors", weight_dtype="auto", device="cpu", offload="keep_loaded")


def test_unknown_device_is_a_clear_error(host, nodes):
    from sdvg_pack_under_test.sdvg.errors import ConfigError

    folder = host.models_dir / "diffusion_models"
    folder.mkdir(parents=True)
    (folder / "x.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="cuda:7"):
        nodes["SDVGModelLoader"].execute(model_name="x.safetensors", weight_dtype="auto", device="cuda:7", offload="keep_loaded")


def test_router_builds_engine_config_and_rejects_bad_values(nodes):
    from sdvg_pack_under_test.sdvg.errors import ConfigError

    kwargs = dict(tau=-0.7, aggregation="min", quantile=0.1, threshold_mode="fixed", target_rate=0.72, delta=0.5,
                  mode="reward", random_rate=0.5, force_reject_first=True, early_exit=False)
    config = nodes["SDVGRewardRouter"].execute(**kwargs)[0]
    assert (config.tau, config.aggregation, config.threshold, config.mode) == (-0.7, "min", "fixed", "reward")
    with pytest.raises(ConfigError, match="aggregation"):
        nodes["SDVGRewardRouter"].execute(**(kwargs | {"aggregation": "median"}))


def test_text_encode_from_native_conditioning_pads_to_512(nodes):
    cond = [[torch.ones(1, 7, 32), {"pooled_output": None}]]
    out = nodes["SDVGTextEncode"].execute(prompt="a fox", conditioning=cond)[0]
    assert out.embeds.shape == (1, 512, 32) and out.embeds[0, 7:].abs().sum() == 0 and out.prompt == "a fox"
    assert cond[0][0].shape == (1, 7, 32)  # input untouched


def test_text_encode_errors_are_clear(nodes):
    from sdvg_pack_under_test.sdvg.errors import ConfigError

    with pytest.raises(ConfigError, match="needs a text encoder"):
        nodes["SDVGTextEncode"].execute(prompt="a fox")
    with pytest.raises(ConfigError, match="prompt text is still needed"):
        nodes["SDVGTextEncode"].execute(prompt="  ", conditioning=[[torch.ones(1, 3, 8), {}]])


def test_report_node_parses_and_renders(nodes):
    report = {"settings": {"num_blocks": 2}, "partial": False, "totals": {"blocks": 2, "drafted": 1, "accepted": 1, "acceptance": 1.0},
              "blocks": [{"block": 0, "decision": "forced", "reason": "block 0", "produced_by": "target", "q": None, "scores": [], "tau": -0.7, "steps": 4, "timings": {}},
                         {"block": 1, "decision": "accept", "reason": "q>=tau", "produced_by": "drafter", "q": 0.1, "scores": [0.1, 0.3], "tau": -0.7, "steps": 4, "timings": {}}]}
    summary, image = nodes["SDVGReport"].execute(report=json.dumps(report), chart_width=400, chart_height=200).args
    assert isinstance(summary, str) and summary
    assert image.shape[0] == 1 and image.shape[-1] == 3 and image.dtype == torch.float32


def test_report_node_rejects_non_json(nodes):
    from sdvg_pack_under_test.sdvg.errors import ConfigError

    with pytest.raises(ConfigError, match="not JSON"):
        nodes["SDVGReport"].execute(report="{oops", chart_width=400, chart_height=200)


def test_preview_encoder_drops_instead_of_blocking():
    preview = pack.load_pack() and pack.submodule("nodes.preview")
    try:
        enc = preview.PreviewEncoder(max_pending=1)
        enc._thread.join(0)  # the thread is running; flood it
        for b in range(50):
            enc.submit(b, torch.rand(12, 16, 16, 3))
        done = enc.close()
        assert len(done) + enc.dropped == 50 and done[-1][0] == 49
        img = preview.contact_sheet(torch.rand(12, 32, 48, 3), max_side=64)
        assert max(img.size) <= 64
    finally:
        pack.unload_pack()


# ------------------------------------------------------------------------------------------- engine-backed
@pytest.fixture(scope="module")
def tiny_root(tiny_dir, tmp_path_factory):
    """A private copy of the session's make-tiny tree (some tests add files to it)."""
    import shutil

    root = tmp_path_factory.mktemp("tiny-models") / "models"
    shutil.copytree(tiny_dir, root)
    return root


@pytest.fixture()
def tiny_host(tiny_root):
    """Stub host whose model folders are a tiny models tree."""
    yield from _stub_host_with_pack(tiny_root, image_reward_folder=tiny_root / "image_reward")


@pytest.fixture()
def tiny_nodes(tiny_host):
    mod = pack.submodule("nodes")
    return {cls.define_schema().node_id: cls for cls in mod.node_classes()}


def _run_tiny(nodes, *, blocks=3, mode="reward", tau=-0.7, schedule_text=None, start_images=None, start_mode=None,
              **sampler_kwargs):
    load = nodes["SDVGModelLoader"].execute
    drafter = load(model_name="sdvg_tiny_drafter.pt", weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    target = load(model_name="sdvg_tiny_target.safetensors", weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    vae = nodes["SDVGVAELoader"].execute(model_name="sdvg_tiny_vae.safetensors", device="cpu", dtype="fp32")[0]
    reward = nodes["SDVGRewardLoader"].execute(model_name="sdvg_tiny_image_reward.pt", device="cpu")[0]
    te = nodes["SDVGTextEncoderLoader"].execute(model_name="sdvg_tiny_umt5.safetensors", device="cpu", dtype="fp32")[0]
    cond = nodes["SDVGTextEncode"].execute(prompt="a red fox in the snow", text_encoder=te)[0]
    if schedule_text is not None:
        cond = nodes["SDVGPromptSchedule"].execute(schedule=schedule_text, text_encoder=te, blend_blocks=0)[0]
    router = nodes["SDVGRewardRouter"].execute(tau=tau, aggregation="min", quantile=0.1, threshold_mode="fixed",
                                               target_rate=0.72, delta=0.5, mode=mode, random_rate=0.5,
                                               force_reject_first=True, early_exit=False)[0]
    if start_images is not None:
        sampler_kwargs["start"] = nodes["SDVGStartFrames"].execute(images=start_images, vae=vae, mode=start_mode,
                                                                   strength=0.0)[0]
    sampler = nodes["SDVGSpeculativeSampler"]
    sampler.hidden = stub.HiddenHolder(unique_id="7")
    kwargs = dict(seed=1, blocks=blocks, width=64, height=64, cache="recompute", schedule="constant",
                  custom_schedule="1000,750,500,250", pipelined=False, refine_from_step=0) | sampler_kwargs
    return sampler.execute(vae=vae, conditioning=cond, router=router, drafter=drafter, target=target, reward=reward, **kwargs), router


def test_sampler_streams_one_preview_and_one_event_per_block(tiny_host, tiny_nodes):
    nodes = tiny_nodes
    out, router = _run_tiny(nodes, blocks=3)
    images, latent, report = out.args
    assert images.shape == (33, 64, 64, 3) and images.dtype == torch.float32
    assert latent["samples"].shape[:3] == (1, 16, 9)
    blocks = tiny_host.events_of("sdvg.block")
    assert [e["block"] for e in blocks] == [0, 1, 2]
    assert all(e["node"] == "7" for e in blocks)
    assert blocks[0]["produced_by"] == "target"
    assert len(tiny_host.previews) == 3
    assert all(p[0] == "7" and p[3][0] == "JPEG" and p[3][2] == max(p[3][1].size) < 512 for p in tiny_host.previews)
    values = [v for _n, v, _t in tiny_host.progress]
    assert values == sorted(values) and values[-1] == tiny_host.progress[-1][2]
    data = json.loads(report)
    assert [b["block"] for b in data["blocks"]] == [0, 1, 2]
    assert len(tiny_host.events_of("sdvg.start")) == 1 and len(tiny_host.events_of("sdvg.done")) == 1
    timeline = out.ui["sdvg_timeline"][0]  # the ui output the web timeline rebuilds from (cache, history)
    assert timeline["blocks"] == blocks and timeline["num_blocks"] == 3
    assert timeline["run"] == tiny_host.events_of("sdvg.start")[0]["run"] and "totals" in timeline
    assert router.seed == 0  # the router input is never mutated (the sampler works on a copy)


def test_prompt_schedule_node_feeds_the_sampler_a_timeline(tiny_host, tiny_nodes):
    schedule = tiny_nodes["SDVGPromptSchedule"]
    assert schedule.validate_inputs(schedule="2: starts late", blend_blocks=0).startswith("The prompt schedule must")
    out, _ = _run_tiny(tiny_nodes, blocks=3, mode="target-only", width=16, height=16,
                       schedule_text="0: a red fox in the snow\n2: the fox jumps")
    data = json.loads(out.args[2])
    assert [b["prompt"] for b in data["blocks"]] == [None, None, "the fox jumps"]
    assert data["settings"]["prompt"] == "a red fox in the snow"


def test_start_frames_node_gives_first_blocks_or_video_to_video(tiny_host, tiny_nodes):
    image = torch.rand(1, 16, 16, 3)
    out, _ = _run_tiny(tiny_nodes, blocks=2, mode="target-only", width=16, height=16, start_images=image,
                       start_mode="first blocks")
    assert [b["produced_by"] for b in json.loads(out.args[2])["blocks"]] == ["input", "target"]
    clip = out.args[0]  # the 21 frames just made, re-generated at strength 0: the clip's own latents
    out2, _ = _run_tiny(tiny_nodes, blocks=2, mode="target-only", width=16, height=16, start_images=clip,
                        start_mode="video-to-video")
    report = json.loads(out2.args[2])
    assert report["settings"]["v2v_strength"] == 0.0 and [b["steps"] for b in report["blocks"]] == [0, 0]


def test_models_are_loaded_once_while_held_and_registered_with_the_host(tiny_host, tiny_nodes):
    import gc

    models = pack.submodule("nodes._models")
    load = tiny_nodes["SDVGModelLoader"].execute
    a = load(model_name="sdvg_tiny_drafter.pt", weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    b = load(model_name="sdvg_tiny_drafter.pt", weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    assert a.loaded() is None and models.size() == 0  # a recipe: read when a run first needs it
    assert a.model is b.model and a.managed is b.managed
    assert a.managed.patcher.model.parts["model"] is a.model  # ComfyUI manages exactly our module
    assert tiny_host.loads[-1] == (["dit sdvg_tiny_drafter.pt"], 0, True)  # counted from the start, fully loaded
    assert models.size() == 1
    del a, b
    gc.collect()
    assert models.size() == 0  # nothing of ours outlives what ComfyUI holds (its output cache)


def test_a_run_brings_its_models_with_the_memory_it_will_allocate(tiny_host, tiny_nodes):
    from sdvg.sampling.footprint import run_memory
    from sdvg.sampling.regimes import CacheConfig

    load = tiny_nodes["SDVGModelLoader"].execute
    held = [load(model_name=name, weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
            for name in ("sdvg_tiny_drafter.pt", "sdvg_tiny_target.safetensors")]
    held = [h.managed for h in held]  # loaded and held here
    held.append(tiny_nodes["SDVGVAELoader"].execute(model_name="sdvg_tiny_vae.safetensors", device="cpu", dtype="fp32")[0])
    _run_tiny(tiny_nodes, blocks=2)  # its loaders find the held models
    names, need, full = tiny_host.loads[-1]
    assert sorted(names) == ["dit sdvg_tiny_drafter.pt", "dit sdvg_tiny_target.safetensors",
                             "reward sdvg_tiny_image_reward.pt", "vae sdvg_tiny_vae.safetensors"]
    assert full is True
    from sdvg.loaders.bundle import SDVGModels

    models = SDVGModels(drafter=held[0].model, target=held[1].model, vae=held[2].model)
    expected = run_memory(models, cache=CacheConfig("recompute"), num_blocks=2, width=64, height=64, mode="reward")
    assert need == expected[torch.device("cpu")] > 0
    assert ["text_encoder sdvg_tiny_umt5.safetensors"] in [n for n, _m, _f in tiny_host.loads]  # before encoding


def test_cancel_stops_within_a_step_and_raises_host_interrupt(tiny_host, tiny_nodes):
    nodes = tiny_nodes
    import comfy.model_management as mm

    tiny_host.interrupt_after_steps = 6  # the user presses Cancel after a few progress updates
    with pytest.raises(mm.InterruptProcessingException):
        _run_tiny(nodes, blocks=5)
    assert len(tiny_host.events_of("sdvg.block")) < 5
    assert tiny_host.interrupted is False  # the flag was consumed by ComfyUI's own check


def test_cancel_can_keep_the_finished_blocks_as_the_node_outputs(tiny_host, tiny_nodes):
    tiny_host.interrupt_after_steps = 6  # Cancel during block 1
    out, _router = _run_tiny(tiny_nodes, blocks=5, on_cancel="keep finished blocks")
    images, latent, report = out.args
    data = json.loads(report)
    finished = len(data["blocks"])
    assert data["partial"] is True and 1 <= finished < 5
    assert images.shape[0] == 12 * finished - 3 and latent["samples"].shape[2] == 3 * finished
    assert tiny_host.interrupted is False  # the Cancel was consumed: the graph goes on with these outputs
    assert len(tiny_host.events_of("sdvg.done")) == 1


def test_sampler_config_errors_are_clear(tiny_host, tiny_nodes):
    nodes = tiny_nodes
    from sdvg_pack_under_test.sdvg.errors import ConfigError

    with pytest.raises(ConfigError, match="custom_schedule is empty"):
        _run_tiny(nodes, schedule="custom", custom_schedule="  ")
    with pytest.raises(ConfigError):
        _run_tiny(nodes, schedule="custom", custom_schedule="250,500")


def test_block_events_tell_the_three_outcomes_apart(tiny_host, tiny_nodes):
    """accept (draft kept), reject (draft rejected, target regenerated), forced (target, no draft) — from
    produced_by / drafted, exactly as the report's block_kind; random routing at 0.5 gives a fixed mix per seed."""
    from sdvg.outputs.report import block_kind

    out, _router = _run_tiny(tiny_nodes, blocks=6, mode="random", seed=3)
    events = tiny_host.events_of("sdvg.block")
    report = json.loads(out.args[2])
    kinds = [e["kind"] for e in events]
    assert kinds == [block_kind(b) for b in report["blocks"]]
    assert kinds[0] == "forced" and {"accept", "reject"} <= set(kinds[1:]), kinds
    for e, b in zip(events, report["blocks"], strict=True):
        assert (e["produced_by"], e["drafted"], e["decision"]) == (b["produced_by"], b["drafted"], b["decision"])
        assert e["produced_by"] == ("drafter" if e["kind"] == "accept" else "target")
        assert e["drafted"] is (e["kind"] != "forced")
        assert set(e["timings"]) and all(isinstance(v, float) for v in e["timings"].values())
        json.dumps(e, allow_nan=False)  # strict JSON: what the browser's JSON.parse accepts


def test_reward_events_carry_q_tau_and_frame_stats(tiny_host, tiny_nodes):
    _run_tiny(tiny_nodes, blocks=3, tau=-0.7)
    events = tiny_host.events_of("sdvg.block")
    for e in events[1:]:  # drafted and scored blocks
        assert e["kind"] in ("accept", "reject") and isinstance(e["q"], float) and e["tau"] == -0.7
        stats = e["frame_stats"]
        assert stats["count"] == len(e["scores"]) == e["frames"]
        assert stats["min"] == pytest.approx(min(e["scores"])) == pytest.approx(e["q"])  # min aggregation
        assert stats["min"] <= stats["mean"] <= stats["max"]
    assert events[0]["kind"] == "forced" and events[0]["frame_stats"] is None


def test_each_preview_is_announced_with_its_block(tiny_host, tiny_nodes):
    _run_tiny(tiny_nodes, blocks=3)
    announced = tiny_host.events_of("sdvg.preview")
    assert [a["block"] for a in announced] == [0, 1, 2] and len(tiny_host.previews) == 3
    assert all(a["node"] == "7" and a["display_node"] == "7" for a in announced)


def test_latent_output_is_raw_vae_space_and_decodes_to_the_images(tiny_host, tiny_nodes):
    out, _router = _run_tiny(tiny_nodes, blocks=2)
    images, latent, _report = out.args
    vae = tiny_nodes["SDVGVAELoader"].execute(model_name="sdvg_tiny_vae.safetensors", device="cpu", dtype="fp32")[0].model
    samples = latent["samples"]
    assert samples.dtype == torch.float32 and samples.device.type == "cpu"
    with torch.no_grad():
        video = vae.model.decode(samples).sample  # the plain (non-streaming) decoder on the raw latents
    frames = ((video[0].clamp(-1, 1) + 1) * 0.5).permute(1, 2, 3, 0)
    torch.testing.assert_close(frames, images, rtol=0, atol=2e-4)
    torch.testing.assert_close(vae.denormalize(vae.normalize(samples)), samples, rtol=0, atol=1e-5)


def test_bad_sampler_settings_are_clear_errors(tiny_host, tiny_nodes):
    from sdvg_pack_under_test.sdvg.errors import ConfigError

    with pytest.raises(ConfigError, match="multiples of 16"):
        _run_tiny(tiny_nodes, width=72)
    with pytest.raises(ConfigError, match="NaN"):
        _run_tiny(tiny_nodes, tau=float("nan"))
    assert not tiny_host.events_of("sdvg.start")  # refused before anything ran


def _write_dit_with_text_dim(models_dir, text_dim: int) -> str:
    from safetensors.torch import save_file

    from sdvg.fixtures.tiny import TINY_TARGET_CONFIG, random_original_state_dict
    from sdvg.loaders.wan_keys import META_NUM_HEADS

    config = dict(TINY_TARGET_CONFIG, text_dim=text_dim)
    sd = random_original_state_dict(config, seed=99)
    name = f"sdvg_test_text{text_dim}.safetensors"
    save_file({"model." + k: v for k, v in sd.items()}, str(models_dir / "diffusion_models" / name),
              metadata={META_NUM_HEADS: str(config["num_attention_heads"])})
    return name


def test_mismatched_drafter_and_target_is_a_clear_error(tiny_host, tiny_nodes):
    """Two DiTs that cannot share one text encoder (different text_dim): a ConfigError naming the field, before
    any model runs; the next run with matching models works."""
    from sdvg_pack_under_test.sdvg.errors import ConfigError

    from sdvg.fixtures.tiny import TINY_TEXT_DIM

    name = _write_dit_with_text_dim(tiny_host.models_dir, TINY_TEXT_DIM * 2)
    try:
        load = tiny_nodes["SDVGModelLoader"].execute
        odd = load(model_name=name, weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
        assert odd.model.config["text_dim"] == TINY_TEXT_DIM * 2
        vae = tiny_nodes["SDVGVAELoader"].execute(model_name="sdvg_tiny_vae.safetensors", device="cpu", dtype="fp32")[0]
        drafter = load(model_name="sdvg_tiny_drafter.pt", weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
        te = tiny_nodes["SDVGTextEncoderLoader"].execute(model_name="sdvg_tiny_umt5.safetensors", device="cpu", dtype="fp32")[0]
        cond = tiny_nodes["SDVGTextEncode"].execute(prompt="a fox", text_encoder=te)[0]
        router = tiny_nodes["SDVGRewardRouter"].execute(tau=-0.7, aggregation="min", quantile=0.1, threshold_mode="fixed",
                                                        target_rate=0.72, delta=0.5, mode="random", random_rate=0.5,
                                                        force_reject_first=True, early_exit=False)[0]
        sampler = tiny_nodes["SDVGSpeculativeSampler"]
        sampler.hidden = stub.HiddenHolder(unique_id="9")
        with pytest.raises(ConfigError, match="text_dim"):
            sampler.execute(vae=vae, conditioning=cond, router=router, drafter=drafter, target=odd, seed=0, blocks=2,
                            width=64, height=64, cache="recompute", schedule="constant", custom_schedule="",
                            pipelined=False, refine_from_step=0)
        assert not tiny_host.events_of("sdvg.start") and not tiny_host.progress
    finally:
        (tiny_host.models_dir / "diffusion_models" / name).unlink()
    out, _router = _run_tiny(tiny_nodes, blocks=1)
    assert out.args[0].shape[0] == 9


def test_cancel_during_a_pipelined_run_leaves_no_threads(tiny_host, tiny_nodes):
    import threading

    import comfy.model_management as mm

    before = {t.ident for t in threading.enumerate()}
    tiny_host.interrupt_after_steps = 10
    with pytest.raises(mm.InterruptProcessingException):
        _run_tiny(tiny_nodes, blocks=5, pipelined=True)
    for t in threading.enumerate():
        if t.ident not in before:
            t.join(5)
    assert not [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]


def test_every_node_and_input_is_documented(nodes):
    """docs/NODES.md (the reference the README links to) and the help page web/docs/<NodeId>.md name every
    node, input and output."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    reference = (repo / "docs" / "NODES.md").read_text(encoding="utf-8")
    missing = []
    for node_id, cls in nodes.items():
        info = stub.node_info(cls)
        page = repo / "web" / "docs" / f"{node_id}.md"
        help_text = page.read_text(encoding="utf-8") if page.exists() else ""
        if not help_text.startswith("# "):
            missing.append(f"{page.name}: missing or without a title")
        if not re.search(rf"^##+ {node_id}\b", reference, re.M):
            missing.append(f"NODES.md: no section for {node_id}")
        names = [n for sec in ("required", "optional") for n in info["input_order"].get(sec, [])]
        for name in names:
            if f"`{name}`" not in reference:
                missing.append(f"NODES.md: {node_id}.{name}")
            if not re.search(rf"\b{name}\b", help_text):
                missing.append(f"{page.name}: {name}")
        for out in info.get("output_name", []):
            if f"`{out}`" not in reference:
                missing.append(f"NODES.md: output {node_id}.{out}")
    for event in ("sdvg.start", "sdvg.block", "sdvg.preview", "sdvg.done"):
        if event not in reference:
            missing.append(f"NODES.md: event {event}")
    assert not missing, "\n".join(missing)


def test_sampler_settings_are_refused_at_queue_time(nodes):
    """ComfyUI runs validate_inputs before executing anything, so a bad size never costs a model load."""
    check = nodes["SDVGSpeculativeSampler"].validate_inputs
    good = dict(seed=0, blocks=3, width=64, height=64, cache="recompute", schedule="constant",
                custom_schedule="1000,750,500,250", refine_from_step=0)
    assert check(**good) is True
    assert "multiples of 16" in check(**(good | {"width": 60}))
    assert "blocks must be between 1 and" in check(**(good | {"blocks": 0}))
    assert "Unknown cache regime" in check(**(good | {"cache": "rolling"}))
    assert "custom_schedule is empty" in check(**(good | {"schedule": "custom", "custom_schedule": " "}))
    assert "strictly decreasing" in check(**(good | {"schedule": "custom", "custom_schedule": "250,500"}))
    assert check(**(good | {"drafter_schedule": "diagonal", "drafter_step_noise": "fresh"})) is True
    assert "refine_from_step continues a draft" in check(**(good | {"drafter_schedule": "diagonal",
                                                                    "refine_from_step": 2}))
    mod = pack.submodule("nodes.sampler")
    cfg = mod.sampler_config(**(good | {"drafter_schedule": "diagonal", "drafter_step_noise": "fresh"}))
    assert [len(r) for r in cfg.step_schedule("drafter")] == [4, 3, 2] and cfg.step_noise_for("drafter") == "fresh"
    same = mod.sampler_config(**good)
    assert same.drafter_schedule is None and same.drafter_step_noise is None  # "same as target" is the engine's None


def test_router_settings_are_refused_at_queue_time(nodes):
    check = nodes["SDVGRewardRouter"].validate_inputs
    good = dict(tau=-0.7, aggregation="min", quantile=0.1, threshold_mode="fixed", target_rate=0.72, delta=0.5,
                mode="reward", random_rate=0.5, force_reject_first=True, early_exit=False)
    assert check(**good) is True
    assert check(**(good | {"mode": "pattern", "pattern": "AARA"})) is True
    assert "string of A (accept) and R (reject)" in check(**(good | {"mode": "pattern", "pattern": ""}))
    assert "quantile" in check(**(good | {"quantile": 1.5}))


def test_offload_policy_parks_the_dit_after_the_run_even_after_an_error(host):
    import contextlib

    models, sampler = pack.submodule("nodes._models"), pack.submodule("nodes.sampler")
    handles = pack.submodule("nodes.handles")

    class Patcher:
        def __init__(self):
            self.detached = 0

        def detach(self, unpatch_all=True):
            self.detached += 1

    def handle(offload):
        managed = models.Managed("dit", "x", object(), torch.device("cuda", 0), Patcher())
        return handles.DiTHandle.of(managed, file="x", dtype="bf16", device=managed.device, offload=offload)

    parked, kept = handle("offload_to_cpu_when_idle"), handle("keep_loaded")
    with contextlib.suppress(RuntimeError), sampler._parked_after((parked, kept, None)):
        raise RuntimeError("the run failed")
    assert parked.managed.patcher.detached == 1 and kept.managed.patcher.detached == 0


def _fake_core_model(original: dict, heads: int, patches: dict | None = None):
    """The part of a core MODEL (ModelPatcher → BaseModel → WanModel) the pack reads."""
    import types as pytypes

    class WanModel(torch.nn.Module):
        model_type, img_emb = "t2v", None

        def __init__(self):
            super().__init__()
            self.num_heads = heads

    class CoreModel:
        model = pytypes.SimpleNamespace(diffusion_model=WanModel())
        patches_uuid = "uuid-1"

        def __init__(self):
            self.patches = patches or {}

        def model_state_dict(self, filter_prefix=None):
            return {filter_prefix + k: v for k, v in original.items()}

    return CoreModel()


def _tiny_target_original(tiny_root) -> dict:
    from safetensors.torch import load_file

    sd = load_file(str(tiny_root / "diffusion_models" / "sdvg_tiny_target.safetensors"))
    return {k.removeprefix("model."): v for k, v in sd.items()}


def test_dit_from_a_core_model_equals_the_file_loader_and_applies_weight_patches(tiny_host, tiny_nodes, tiny_root,
                                                                                 monkeypatch):
    import sys
    import types as pytypes

    original = _tiny_target_original(tiny_root)
    from_file = tiny_nodes["SDVGModelLoader"].execute(model_name="sdvg_tiny_target.safetensors", weight_dtype="fp32",
                                                       device="cpu", offload="keep_loaded")[0].model
    convert = tiny_nodes["SDVGDiTFromModel"].execute
    plain = convert(model=_fake_core_model(original, heads=8), weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    ref = dict(from_file.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in plain.model.named_parameters())
    # a weight patch goes through comfy.lora.calculate_weight (ComfyUI's own LoRA maths; a stand-in here)
    lora = pytypes.ModuleType("comfy.lora")
    lora.calculate_weight = lambda patches, weight, key: weight + sum(p[0] * p[1] for p in patches)
    monkeypatch.setitem(sys.modules, "comfy.lora", lora)
    key = "blocks.0.self_attn.q.weight"
    delta = torch.full(original[key].shape, 0.25)
    patched = convert(model=_fake_core_model(original, heads=8, patches={"diffusion_model." + key: [(0.5, delta)]}),
                      weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    name = "blocks.0.attn1.to_q.weight"
    assert torch.equal(dict(patched.model.named_parameters())[name], ref[name] + 0.125)
    assert torch.equal(dict(patched.model.named_parameters())["blocks.0.attn1.to_k.weight"], ref["blocks.0.attn1.to_k.weight"])


def test_dit_from_a_core_model_refuses_what_it_cannot_take(tiny_host, tiny_nodes, tiny_root):
    ConfigError = pack.submodule("sdvg.errors").ConfigError
    convert = tiny_nodes["SDVGDiTFromModel"].execute
    i2v = _fake_core_model(_tiny_target_original(tiny_root), heads=8)
    i2v.model.diffusion_model.model_type = "i2v"
    with pytest.raises(ConfigError, match="text-to-video"):
        convert(model=i2v, weight_dtype="fp32", device="cpu", offload="keep_loaded")


def test_dit_from_a_scaled_fp8_core_model_keeps_fp8_and_applies_the_scales(tiny_host, tiny_nodes, tiny_root):
    """A scaled-fp8 MODEL (fp8 weights, scale_weight entries, the scaled_fp8 marker) converts; its layers stay fp8 +
    scale and compute weight.float() * scale (tests/test_core_quant.py checks the forward bit for bit)."""
    convert = tiny_nodes["SDVGDiTFromModel"].execute
    original = _tiny_target_original(tiny_root)
    key = "blocks.0.self_attn.q.weight"
    weights = {**original, "scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    weights[key] = (original[key] / 0.25).to(torch.float8_e4m3fn)
    weights["blocks.0.self_attn.q.scale_weight"] = torch.tensor([0.25])
    dit = convert(model=_fake_core_model(weights, heads=8), weight_dtype="fp32", device="cpu",
                  offload="keep_loaded")[0]
    layer = dit.model.blocks[0].attn1.to_q
    assert layer.type_name == "fp8_scaled" and layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.dequantized(), weights[key].float() * 0.25)


def test_the_readme_names_the_nodes_as_comfyui_shows_them(nodes):
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    missing = [cls.define_schema().display_name for cls in nodes.values()
               if f"**{cls.define_schema().display_name}**" not in readme]
    assert not missing, missing


def test_lora_chain_reads_the_dit_once_with_every_lora_merged(tiny_host, tiny_nodes, tiny_root):
    from sdvg.fixtures.loras import lora_factors, write_lora
    from sdvg.fixtures.tiny import TINY_TARGET_CONFIG
    from sdvg.loaders.lora import LoraSpec
    from sdvg.loaders.wan import load_dit

    loras = tiny_root / "loras"
    a = write_lora(loras / "style_a.safetensors", lora_factors(TINY_TARGET_CONFIG, seed=1), "kohya")
    b = write_lora(loras / "style_b.safetensors", lora_factors(TINY_TARGET_CONFIG, seed=2), "diffusers")
    base = tiny_nodes["SDVGModelLoader"].execute(model_name="sdvg_tiny_target.safetensors", weight_dtype="fp32",
                                                  device="cpu", offload="keep_loaded")[0]
    add = tiny_nodes["SDVGLoraLoader"].execute
    one = add(dit=base, lora_name="style_a.safetensors", strength=0.8)[0]
    two = add(dit=one, lora_name="style_b.safetensors", strength=-0.5)[0]
    assert add(dit=two, lora_name="style_a.safetensors", strength=0.0)[0] is two  # strength 0: unchanged
    assert base.loaded() is None and one.loaded() is None  # nothing read yet, and never for the bare base
    ref = load_dit(tiny_root / "diffusion_models" / "sdvg_tiny_target.safetensors", dtype="fp32", device="cpu",
                   loras=[LoraSpec(a, 0.8), LoraSpec(b, -0.5)])
    got = dict(two.model.named_parameters())
    assert all(torch.equal(p, got[n]) for n, p in ref.named_parameters())
    assert base.loaded() is None and one.loaded() is None


def test_lora_node_errors_name_the_problem(tiny_host, tiny_nodes, tiny_root):
    from sdvg.fixtures.loras import lora_factors, write_lora
    from sdvg.fixtures.tiny import TINY_DRAFTER_CONFIG

    ConfigError = pack.submodule("sdvg.errors").ConfigError
    write_lora(tiny_root / "loras" / "for_the_drafter.safetensors", lora_factors(TINY_DRAFTER_CONFIG), "kohya")
    target = tiny_nodes["SDVGModelLoader"].execute(model_name="sdvg_tiny_target.safetensors", weight_dtype="fp32",
                                                    device="cpu", offload="keep_loaded")[0]
    with pytest.raises(ConfigError):  # a LoRA made for another width fails on this node, before any load
        tiny_nodes["SDVGLoraLoader"].execute(dit=target, lora_name="for_the_drafter.safetensors", strength=1.0)
    assert "not found" in tiny_nodes["SDVGLoraLoader"].validate_inputs(lora_name="missing.safetensors")
    core = _fake_core_model(_tiny_target_original(tiny_root), heads=8)
    from_core = tiny_nodes["SDVGDiTFromModel"].execute(model=core, weight_dtype="fp32", device="cpu",
                                                       offload="keep_loaded")[0]
    with pytest.raises(ConfigError, match="LoraLoaderModelOnly"):
        tiny_nodes["SDVGLoraLoader"].execute(dit=from_core, lora_name="for_the_drafter.safetensors", strength=1.0)


def test_lora_node_skips_i2v_keys_and_strict_refuses_them(tiny_host, tiny_nodes, tiny_root):
    from safetensors.torch import save_file

    from sdvg.fixtures.loras import lora_factors, lora_state_dict
    from sdvg.fixtures.tiny import TINY_TARGET_CONFIG

    ModelFileError = pack.submodule("sdvg.errors").ModelFileError
    sd, _ = lora_state_dict(lora_factors(TINY_TARGET_CONFIG, seed=4), "kohya")
    sd["lora_unet_blocks_0_cross_attn_k_img.lora_down.weight"] = torch.zeros(4, 512)
    save_file(sd, str(tiny_root / "loras" / "an_i2v_lora.safetensors"))
    target = tiny_nodes["SDVGModelLoader"].execute(model_name="sdvg_tiny_target.safetensors", weight_dtype="fp32",
                                                    device="cpu", offload="keep_loaded")[0]
    add = tiny_nodes["SDVGLoraLoader"].execute
    assert add(dit=target, lora_name="an_i2v_lora.safetensors", strength=1.0)[0].loras  # the T2V part applies
    with pytest.raises(ModelFileError, match="strict LoRA matching refuses them"):
        add(dit=target, lora_name="an_i2v_lora.safetensors", strength=1.0, strict=True)


def test_block_offload_on_the_loader_streams_blocks_comfy_does_not_move(tiny_host, tiny_nodes):
    load = tiny_nodes["SDVGModelLoader"].execute
    plain = load(model_name="sdvg_tiny_target.safetensors", weight_dtype="fp32", device="cpu", offload="keep_loaded")[0]
    streamed = load(model_name="sdvg_tiny_target.safetensors", weight_dtype="fp32", device="cpu", offload="keep_loaded",
                    block_offload="custom", resident_blocks=1)[0]
    assert streamed.model is not plain.model and streamed.model.block_offloader.resident == 1
    parts = streamed.managed.patcher.model.parts
    assert sorted(k for k in parts if k.startswith("block_")) == ["block_0"]  # streamed blocks are not ComfyUI's to move
    assert "child_blocks" not in parts and plain.managed.patcher.model.parts["model"] is plain.model
    # the same weights (bit-identical outputs through the offloader: tests/test_offload.py)
    ref = dict(plain.model.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in streamed.model.named_parameters())
    ConfigError = pack.submodule("sdvg.errors").ConfigError
    assert "resident_blocks" in tiny_nodes["SDVGModelLoader"].validate_inputs(
        model_name="sdvg_tiny_target.safetensors", block_offload="custom", resident_blocks=-1)
    with pytest.raises(ConfigError):
        load(model_name="sdvg_tiny_target.safetensors", weight_dtype="fp32", device="cpu", offload="keep_loaded",
             block_offload="sometimes")


def test_the_dit_loader_lists_and_loads_a_gguf_file(tiny_host, tiny_nodes, tiny_root):
    pytest.importorskip("gguf")
    from sdvg.fixtures.quant_files import write_gguf_dit
    from sdvg.fixtures.tiny import TINY_TARGET_CONFIG, random_original_state_dict

    write_gguf_dit(tiny_root / "diffusion_models" / "sub" / "target-Q4_K.gguf",
                   random_original_state_dict(TINY_TARGET_CONFIG, seed=2), qtype="Q4_K", num_heads=8)
    options = stub.node_info(tiny_nodes["SDVGModelLoader"])["input"]["required"]["model_name"][0]
    assert "sub/target-Q4_K.gguf" in options and "sdvg_tiny_target.safetensors" in options
    dit = tiny_nodes["SDVGModelLoader"].execute(model_name="sub/target-Q4_K.gguf", weight_dtype="fp32", device="cpu",
                                                offload="keep_loaded")[0]
    assert dit.model.blocks[0].attn1.to_q.type_name == "Q4_K"
