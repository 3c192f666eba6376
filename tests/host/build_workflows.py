"""Write the shipped workflows (UI format + .jpg thumbnail) and their API-format twins.

    .venv/bin/python -m tests.host.build_workflows          # rewrite workflows/ and tests/workflows/

The UI files are built from the node schemas (widget order and defaults come from there), so they cannot drift
from the nodes; ``tests/test_workflows.py`` rebuilds them in memory and compares with the committed files.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sdvg.toy.preset import TOY_SCHEDULE, TOY_STEP_NOISE, TOY_TAU, toy_drafter_sampling, toy_files

from . import pack, stub
from .core_nodes import CORE_NODES
from .schema_checks import widget_inputs
from .ui_to_api import ui_to_api

REPO = Path(__file__).resolve().parents[2]
UI_DIR = REPO / "workflows"  # ComfyUI lists it as the pack's templates, titled by file name
API_DIR = REPO / "tests" / "workflows"

FILES_REAL = {
    "drafter": "self_forcing_dmd.pt",
    "target": "krea-realtime-video-14b.safetensors",
    "text_encoder": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
    "vae": "wan_2.1_vae.safetensors",
    "reward": "ImageReward.pt",
}
FILES_TINY = {
    "drafter": "sdvg_tiny_drafter.pt",
    "target": "sdvg_tiny_target.safetensors",
    "text_encoder": "sdvg_tiny_umt5.safetensors",
    "vae": "sdvg_tiny_vae.safetensors",
    "reward": "sdvg_tiny_image_reward.pt",
}
FILES_TOY = {role: path.name for role, path in toy_files().items()}  # the committed tree's (its stamp's) files
TOY_DRAFTER = {f"drafter_{k}": v for k, v in toy_drafter_sampling().items()}  # the toy drafter's own sampling
TOY_CAPTION = "a red circle moving right on a black background"
PROMPT = (
    "A red fox trots through fresh snow in a quiet pine forest at sunrise, soft golden light, "
    "breath visible in the cold air, tracking shot"
)

NOTE_REAL = """## Model files (put them in these ComfyUI folders)

| file | folder | where to get it |
|---|---|---|
| `self_forcing_dmd.pt` (drafter, Self-Forcing 1.3B) | `models/diffusion_models/` | Hugging Face `gdhe17/Self-Forcing`, file `checkpoints/self_forcing_dmd.pt` |
| `krea-realtime-video-14b.safetensors` (target, Krea Realtime 14B, 28.6 GB bf16) | `models/diffusion_models/` | Hugging Face `krea/krea-realtime-video` |
| `umt5_xxl_fp8_e4m3fn_scaled.safetensors` (UMT5-XXL text encoder) | `models/text_encoders/` | Hugging Face `Comfy-Org/Wan_2.1_ComfyUI_repackaged`, `split_files/text_encoders/` |
| `wan_2.1_vae.safetensors` (Wan 2.1 VAE) | `models/vae/` | Hugging Face `Comfy-Org/Wan_2.1_ComfyUI_repackaged`, `split_files/vae/` |
| `ImageReward.pt` **and** `vocab.txt` beside it | `models/image_reward/` | Hugging Face `THUDM/ImageReward` (`ImageReward.pt`); `vocab.txt` from `bert-base-uncased` |

Nothing is downloaded at run time. On two GPUs set the text encoder, VAE and ImageReward loaders' device to `cuda:1` (paper split); the DiTs stay on `cuda:0`.
"""

NOTE_LONG = """
## Long videos

The caches, the VAE state and the history are flat in the block count (`recompute`, or `noisy` with `positions` =
`window`); the `images` output is one batch of every frame (4.8 MB a frame at 832×480: 3.2 GB here). For minutes of
video use the CLI, which streams frames to the mp4 as they come: `python -m sdvg generate --blocks 400 --out long.mp4`.
"""

NOTE_V2V = """
## Video-to-video

Put an 832×480 clip of at least 81 frames (7 blocks: 12 × blocks − 3) into ComfyUI's `input/` folder as
`sdvg_input.mp4` (or pick yours in Load Video). Every block starts from the clip's latents noised to `strength`
(1 = text-to-video, 0 = the clip); drafter and target alike, so the router works as usual. Mode `first blocks`
instead makes the clip (or an image) the video's first blocks and generates the rest.
"""

TIMELINE = (
    "0: A red fox trots through fresh snow in a quiet pine forest at sunrise, tracking shot\n"
    "4: The red fox leaps over a frozen stream, snow spraying, tracking shot\n"
    "8: The red fox sits on a rock at the forest edge and looks at the valley, golden light"
)

NOTE_TOY = """## Toy world on the CPU (trained models: you can see and judge what comes out)

The pack ships tiny models trained on its toy world (`python -m sdvg toy train`): one flat-coloured shape moving on a
plain background, 64×64. They are already in ComfyUI's model lists (the pack adds `sdvg/toy/models/` to them):

* `diffusion_models/sdvg_toy_target.safetensors` (target), `diffusion_models/sdvg_toy_student.pt` (drafter: the
  target distilled by Diagonal Distillation into a few-step student)
* `text_encoders/sdvg_toy_umt5.safetensors`, `vae/sdvg_toy_patch_vae.safetensors` (a linear patch latent model with
  the streaming VAE's interface, not a Wan VAE)
* `image_reward/sdvg_toy_critic.pt` (+ its vocab and config), the critic in ImageReward's format

Prompts are toy captions: `a <red|green|blue|yellow|magenta|cyan> <circle|square|triangle> moving
<left|right|up|down> on a <black|white|grey> background`. The target is a 1.2 M-parameter causal DiT (4 layers, 64
tokens a frame), a flow-matching model: it samples with its own 10-step list (the custom schedule below) and
`step_noise` = fresh. The drafter is the same network distilled (DMD with the noisy cache): it samples on its own
`drafter_schedule` = diagonal-1 (4 steps for block 0, then one step a block; it was trained on diagonal 4, 3, 2) with
`drafter_step_noise` = fresh: 5.7× less time a block than the target, 0.97× its judge. The critic is a tiny
ImageReward trained on the world; τ is on its scale (−2 broken or wrong, +2 a clean frame that matches).
"""

NOTE_TINY = """## Tiny CPU preset (random weights: the video is noise, the pipeline is real)

Create the files once with `python -m sdvg make-tiny <ComfyUI>/models` (or any folder mapped in `extra_model_paths.yaml`). It writes:

* `diffusion_models/sdvg_tiny_drafter.pt`, `diffusion_models/sdvg_tiny_target.safetensors`
* `text_encoders/sdvg_tiny_umt5.safetensors`, `vae/sdvg_tiny_vae.safetensors`
* `image_reward/sdvg_tiny_image_reward.pt` (+ its `vocab.txt`)

Runs in seconds on a CPU; use it to check an install. τ = −0.95 sits inside the range the tiny random
ImageReward scores frames at (about −1.05 … −0.9), so the timeline shows all three outcomes: the target's
block 0 (no draft), accepted drafts and drafts the target regenerated.
"""


@dataclass
class Spec:
    name: str  # the id: the API twin's name (tests/workflows/NAME.api.json) and the workflow's uuid
    file: str  # the UI file's name in workflows/ without .json: the template's title in ComfyUI's browser
    title: str
    subtitle: str
    nodes: list[dict] = field(default_factory=list)  # {"key", "type", "pos", "values": {...}, "title"}
    links: list[tuple] = field(default_factory=list)  # (src_key, src_slot, dst_key, dst_input_name)
    notes: list[tuple] = field(default_factory=list)  # (text, pos, size)


def _loader_nodes(files: dict, *, dtype: str, device: str, roles: tuple[str, ...]) -> list[dict]:
    nodes = []
    y = 60
    for role in roles:
        if role in ("drafter", "target"):
            nodes.append({"key": role, "type": "SDVGModelLoader", "pos": [40, y], "title": f"Load {role} DiT",
                          "values": {"model_name": files[role], "weight_dtype": dtype, "device": device}})
        elif role == "text_encoder":
            nodes.append({"key": role, "type": "SDVGTextEncoderLoader", "pos": [40, y],
                          "values": {"model_name": files[role], "device": device}})
        elif role == "vae":
            nodes.append({"key": role, "type": "SDVGVAELoader", "pos": [40, y], "values": {"model_name": files[role], "device": device}})
        elif role == "reward":
            nodes.append({"key": role, "type": "SDVGRewardLoader", "pos": [40, y], "values": {"model_name": files[role], "device": device}})
        y += 150
    return nodes


def _spec(name, file, title, subtitle, files, note, *, roles, router, sampler, dtype="auto", device="auto", fps=16.0,
          encode=None, start_from=None) -> Spec:
    spec = Spec(name, file, title, subtitle)
    spec.nodes += _loader_nodes(files, dtype=dtype, device=device, roles=roles)
    spec.nodes += [
        encode or {"key": "encode", "type": "SDVGTextEncode", "pos": [420, 60], "values": {"prompt": PROMPT}},
        {"key": "router", "type": "SDVGRewardRouter", "pos": [420, 320], "values": router},
        {"key": "sampler", "type": "SDVGSpeculativeSampler", "pos": [820, 60], "values": sampler, "size": [440, 720]},
        {"key": "video", "type": "CreateVideo", "pos": [1320, 60], "values": {"fps": fps}},
        {"key": "save", "type": "SaveVideo", "pos": [1320, 220], "values": {"filename_prefix": f"video/{name}"}},
        {"key": "report", "type": "SDVGReport", "pos": [1320, 720], "values": {}},
        {"key": "chart", "type": "PreviewImage", "pos": [1700, 420], "values": {}},
        {"key": "summary", "type": "PreviewAny", "pos": [1700, 60], "size": [420, 300], "values": {}},
    ]
    if "text_encoder" in roles:
        spec.links.append(("text_encoder", 0, "encode", "text_encoder"))
    for role in ("drafter", "target", "vae", "reward"):
        if role in roles:
            spec.links.append((role, 0, "sampler", role))
    spec.links += [
        ("encode", 0, "sampler", "conditioning"),
        ("router", 0, "sampler", "router"),
        ("sampler", 0, "video", "images"),
        ("video", 0, "save", "video"),
        ("sampler", 2, "report", "report"),
        ("report", 1, "chart", "images"),
        ("report", 0, "summary", "source"),
    ]
    if start_from is not None:  # a clip to start from: Load Video → Get Video Components → SDVG Start Frames
        spec.nodes += [
            {"key": "load_video", "type": "LoadVideo", "pos": [420, 560], "values": {"file": start_from["file"]}},
            {"key": "components", "type": "GetVideoComponents", "pos": [420, 720], "values": {}},
            {"key": "start", "type": "SDVGStartFrames", "pos": [420, 860], "values": start_from["values"]},
        ]
        spec.links += [("load_video", 0, "components", "video"), ("components", 0, "start", "images"),
                       ("vae", 0, "start", "vae"), ("start", 0, "sampler", "start")]
    spec.notes.append((note, [40, 60 + 150 * len(roles) + 20], [740, 330]))
    return spec


def specs() -> list[Spec]:
    all_roles = ("drafter", "target", "text_encoder", "vae", "reward")
    return [
        _spec(
            "sdvg_speculative_t2v", "Speculative text-to-video",
            "SDVG speculative T2V", "Self-Forcing drafter + Krea 14B target, ImageReward τ = −0.7 (min)",
            FILES_REAL, NOTE_REAL, roles=all_roles,
            router={"tau": -0.7, "aggregation": "min", "mode": "reward"},
            sampler={"seed": 42, "blocks": 7, "width": 832, "height": 480},
        ),
        _spec(
            "sdvg_target_only_baseline", "Target-only baseline",
            "Target-only baseline", "Krea 14B alone: the quality and speed reference",
            FILES_REAL, NOTE_REAL, roles=("target", "text_encoder", "vae"),
            router={"mode": "target-only"},
            sampler={"seed": 42, "blocks": 7, "width": 832, "height": 480},
        ),
        _spec(
            "sdvg_diagonal_noisy_cache", "Diagonal Distillation with noisy cache",
            "Diagonal Distillation", "Self-Forcing with diagonal steps + noisy KV cache (draft-only)",
            FILES_REAL, NOTE_REAL, roles=("drafter", "text_encoder", "vae"),
            router={"mode": "draft-only", "force_reject_first": False},
            sampler={"seed": 42, "blocks": 7, "width": 832, "height": 480, "cache": "noisy", "schedule": "diagonal"},
        ),
        _spec(
            "sdvg_long_video", "Long video",
            "Long video", "56 blocks (669 frames, 42 s): recompute cache, memory flat in the length",
            FILES_REAL, NOTE_REAL + NOTE_LONG, roles=all_roles,
            router={"tau": -0.7, "aggregation": "min", "mode": "reward"},
            sampler={"seed": 42, "blocks": 56, "width": 832, "height": 480, "cache": "recompute"},
        ),
        _spec(
            "sdvg_prompt_timeline", "Prompt timeline",
            "Prompt timeline", "Three prompts over 12 blocks, blended over one block (Krea)",
            FILES_REAL, NOTE_REAL, roles=all_roles,
            router={"tau": -0.7, "aggregation": "min", "mode": "reward"},
            sampler={"seed": 42, "blocks": 12, "width": 832, "height": 480},
            encode={"key": "encode", "type": "SDVGPromptSchedule", "pos": [420, 60], "size": [360, 200],
                    "values": {"schedule": TIMELINE, "blend_blocks": 1}},
        ),
        _spec(
            "sdvg_video_to_video", "Video-to-video",
            "Video-to-video", "A clip re-generated at strength 0.6 (Krea v2v), speculative",
            FILES_REAL, NOTE_REAL + NOTE_V2V, roles=all_roles,
            router={"tau": -0.7, "aggregation": "min", "mode": "reward"},
            sampler={"seed": 42, "blocks": 7, "width": 832, "height": 480},
            start_from={"file": "sdvg_input.mp4", "values": {"mode": "video-to-video", "strength": 0.6}},
        ),
        _spec(
            "sdvg_toy_cpu", "Toy world on the CPU",
            "SDVG toy world (CPU)", "Trained toy models, 64×64: shapes you can judge, in seconds",
            FILES_TOY, NOTE_TOY, roles=all_roles, dtype="fp32", device="cpu",
            encode={"key": "encode", "type": "SDVGTextEncode", "pos": [420, 60], "values": {"prompt": TOY_CAPTION}},
            router={"tau": TOY_TAU, "aggregation": "min", "mode": "reward"},
            sampler={"seed": 0, "blocks": 3, "width": 64, "height": 64, "schedule": "custom",
                     "custom_schedule": json.dumps(TOY_SCHEDULE), "step_noise": TOY_STEP_NOISE, **TOY_DRAFTER},
        ),
        _spec(
            "sdvg_tiny_cpu", "Tiny models install check",
            "SDVG tiny CPU check", "Random tiny models, 64×64, 6 blocks: tests an install in seconds",
            FILES_TINY, NOTE_TINY, roles=all_roles, dtype="fp32", device="cpu",
            # τ −0.95 sits inside the tiny random reward's score range (about −1.05 … −0.9), so a run shows all
            # three outcomes: block 0 forced, then accepted and rejected drafts
            router={"tau": -0.95, "aggregation": "min", "mode": "reward"},
            sampler={"seed": 2, "blocks": 6, "width": 64, "height": 64},
            fps=8.0,
        ),
    ]


def object_info() -> dict:
    """Our nodes' /object_info (from the schemas, through the stub host) plus the core table."""
    installed = False
    if "comfy_api" not in __import__("sys").modules:
        stub.install(Path(tempfile.mkdtemp(prefix="sdvg-models-")))
        installed = True
    try:
        pack.load_pack()
        info = {cls.define_schema().node_id: stub.node_info(cls) for cls in pack.submodule("nodes").node_classes()}
    finally:
        pack.unload_pack()
        if installed:
            stub.uninstall()
    return info | CORE_NODES


def _socket_inputs(info: dict) -> list[tuple[str, str]]:
    widgets = {name for name, _t, _o in widget_inputs(info)}
    out = []
    for section in ("required", "optional"):
        for name in info["input_order"].get(section, []):
            if name not in widgets:
                type_slot = info["input"][section][name][0]
                out.append((name, type_slot if isinstance(type_slot, str) else "COMBO"))
    return out


def build_ui(spec: Spec, info: dict) -> dict:
    ids = {n["key"]: i + 1 for i, n in enumerate(spec.nodes)}
    links = []
    for k, (src, src_slot, dst, dst_name) in enumerate(spec.links, start=1):
        src_type = info[next(n["type"] for n in spec.nodes if n["key"] == src)]["output"][src_slot]
        links.append([k, ids[src], src_slot, ids[dst], dst_name, src_type])
    nodes = []
    for order, n in enumerate(spec.nodes):
        node_info = info[n["type"]]
        values = []
        for name, type_slot, opts in widget_inputs(node_info):
            default = opts.get("default")
            if default is None and isinstance(type_slot, list) and type_slot:
                default = type_slot[0]
            value = n["values"].get(name, default)
            if value is None:
                raise ValueError(f"{spec.name}: no value for {n['type']}.{name}")
            values.append(value)
            if opts.get("control_after_generate"):
                values.append("fixed")
        inputs = []
        for slot, (name, type_name) in enumerate(_socket_inputs(node_info)):
            link = next((lk for lk in links if lk[3] == ids[n["key"]] and lk[4] == name), None)
            if link is not None:
                link[4] = slot
            inputs.append({"name": name, "type": type_name, "link": link[0] if link else None})
        outputs = []
        for slot, type_name in enumerate(node_info["output"]):
            out_links = [lk[0] for lk in links if lk[1] == ids[n["key"]] and lk[2] == slot]
            name = node_info.get("output_name", node_info["output"])[slot]
            outputs.append({"name": name, "type": type_name, "links": out_links or None, "slot_index": slot})
        node = {
            "id": ids[n["key"]], "type": n["type"], "pos": n["pos"], "size": n.get("size", [340, 130]), "flags": {},
            "order": order, "mode": 0, "inputs": inputs, "outputs": outputs,
            "properties": {"Node name for S&R": n["type"]}, "widgets_values": values,
        }
        if n.get("title"):
            node["title"] = n["title"]
        nodes.append(node)
    next_id = len(nodes) + 1
    for text, pos, size in spec.notes:
        nodes.append({"id": next_id, "type": "MarkdownNote", "pos": pos, "size": size, "flags": {}, "order": len(nodes),
                      "mode": 0, "inputs": [], "outputs": [], "properties": {}, "widgets_values": [text],
                      "title": "Model files", "color": "#432", "bgcolor": "#653"})
        next_id += 1
    return {
        "id": _uuid_for(spec.name),
        "revision": 0, "last_node_id": next_id - 1, "last_link_id": len(links), "nodes": nodes, "links": links,
        "groups": [], "config": {}, "extra": {"ds": {"scale": 0.7, "offset": [0, 0]}}, "version": 0.4,
    }


def _uuid_for(name: str) -> str:
    import uuid

    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"sdvg-workflow:{name}"))


def thumbnail(spec: Spec, path: Path) -> None:
    """A small card: title, subtitle and a block timeline motif in the widget's colours
    (F = target without a draft, A = draft accepted, R = draft rejected and regenerated by the target)."""
    from PIL import Image, ImageDraw

    colors = {"F": (91, 141, 239), "A": (79, 191, 122), "R": (232, 104, 74)}
    img = Image.new("RGB", (512, 288), (24, 26, 33))
    draw = ImageDraw.Draw(img)
    draw.text((24, 24), spec.title, fill=(235, 235, 240))
    draw.text((24, 48), spec.subtitle, fill=(160, 165, 180))
    pattern = {"sdvg_target_only_baseline": "FFFFFFF", "sdvg_diagonal_noisy_cache": "AAAAAAA",
               "sdvg_tiny_cpu": "FARAAR", "sdvg_prompt_timeline": "FAAFAAF"}.get(spec.name, "FAARAAR")
    for i, kind in enumerate(pattern):
        x = 24 + i * 66
        draw.rounded_rectangle((x, 120, x + 58, 220), radius=8, fill=colors[kind])
        draw.text((x + 22, 160), str(i), fill=(20, 20, 20))
    draw.text((24, 246), "SDVG: speculative decoding for autoregressive video", fill=(120, 125, 140))
    img.save(path, "JPEG", quality=88)


def ui_path(name: str) -> Path:
    """The shipped UI file of the workflow ``name`` (its id, e.g. ``sdvg_tiny_cpu``)."""
    return UI_DIR / f"{next(spec.file for spec in specs() if spec.name == name)}.json"


def build_all(info: dict | None = None) -> dict[str, tuple[dict, dict]]:
    info = info or object_info()
    out = {}
    for spec in specs():
        ui = build_ui(spec, info)
        out[spec.name] = (ui, ui_to_api(ui, info))
    return out


def dump(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    UI_DIR.mkdir(exist_ok=True)
    API_DIR.mkdir(parents=True, exist_ok=True)
    for spec in specs():
        thumbnail(spec, ui_path(spec.name).with_suffix(".jpg"))
    for name, (ui, api) in build_all().items():
        ui_path(name).write_text(dump(ui), encoding="utf-8")
        (API_DIR / f"{name}.api.json").write_text(dump(api), encoding="utf-8")


if __name__ == "__main__":
    main()
