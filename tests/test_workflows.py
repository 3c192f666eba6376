"""The shipped workflows: only known node types, widget values that fit the schemas, notes naming the files,
thumbnails, API twins produced by the tested converter, and no drift from the generator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from tests.host import build_workflows
from tests.host.core_nodes import CORE_NODES, VIRTUAL_NODES
from tests.host.schema_checks import value_problems, widget_inputs
from tests.host.ui_to_api import ConversionError, ui_to_api, widget_values

REPO = Path(__file__).resolve().parent.parent
UI_FILES = sorted((REPO / "workflows").glob("*.json"))
NAME_OF = {spec.file: spec.name for spec in build_workflows.specs()}  # file stem → workflow id
FILE_WIDGETS = {"model_name", "file"}


@pytest.fixture(scope="module")
def object_info():
    return build_workflows.object_info()


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_workflows_exist():
    names = {NAME_OF.get(p.stem) for p in UI_FILES}
    assert names == {"sdvg_speculative_t2v", "sdvg_target_only_baseline", "sdvg_diagonal_noisy_cache", "sdvg_tiny_cpu", "sdvg_toy_cpu",
                     "sdvg_long_video", "sdvg_prompt_timeline", "sdvg_video_to_video"}


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_workflow_is_valid(path, object_info):
    wf = _load(path)
    assert wf["version"] == 0.4 and wf["nodes"] and wf["links"]
    problems = []
    types = set()
    for node in wf["nodes"]:
        types.add(node["type"])
        if node["type"] in VIRTUAL_NODES:
            continue
        assert node["type"] in object_info, f"unknown node type {node['type']}"
        assert node["type"].startswith("SDVG") or node["type"] in CORE_NODES
        info = object_info[node["type"]]
        values = widget_values(node, info)
        for name, type_slot, opts in widget_inputs(info):
            where = f"{path.stem}:{node['type']}.{name}"
            value = values[name]
            if name in FILE_WIDGETS:
                if not (isinstance(value, str) and re.fullmatch(r"[\w.\-]+\.(safetensors|pt|pth|mp4)", value)):
                    problems.append(f"{where}: {value!r} is not a plain model file name")
                continue
            problems += value_problems(where, type_slot, opts, value)
            if isinstance(value, str) and re.search(r"(^/|[A-Za-z]:\\|\\\\|/home/|/Users/)", value):
                problems.append(f"{where}: OS path {value!r}")
    assert not problems, "\n".join(problems)
    assert {"CreateVideo", "SaveVideo", "SDVGSpeculativeSampler", "MarkdownNote"} <= types
    thumb = path.with_suffix(".jpg")
    with Image.open(thumb) as img:
        assert img.format == "JPEG" and img.width >= 256


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_notes_name_every_model_file(path):
    wf = _load(path)
    notes = "\n".join(str(v) for n in wf["nodes"] if n["type"] in VIRTUAL_NODES for v in n["widgets_values"])
    for node in wf["nodes"]:
        if node["type"].startswith("SDVG") and node["type"].endswith("Loader"):
            assert node["widgets_values"][0] in notes, f"{node['widgets_values'][0]} not explained in a note"
    folders = {"SDVGModelLoader": "diffusion_models", "SDVGTextEncoderLoader": "text_encoders", "SDVGVAELoader": "vae", "SDVGRewardLoader": "image_reward"}
    for node in wf["nodes"]:
        if node["type"] in folders:
            assert folders[node["type"]] in notes


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_api_twin_matches_converter(path, object_info):
    api = ui_to_api(_load(path), object_info)
    twin = _load(REPO / "tests" / "workflows" / f"{NAME_OF[path.stem]}.api.json")
    assert api == twin
    assert all(n["class_type"] not in VIRTUAL_NODES for n in api.values())


def test_generator_has_no_drift(object_info):
    for name, (ui, _api) in build_workflows.build_all(object_info).items():
        assert _load(build_workflows.ui_path(name)) == json.loads(build_workflows.dump(ui)), f"rerun build_workflows for {name}"


def test_tiny_workflow_uses_the_make_tiny_files():
    wf = _load(build_workflows.ui_path("sdvg_tiny_cpu"))
    files = {n["widgets_values"][0] for n in wf["nodes"] if n["type"].endswith("Loader")}
    assert files == set(build_workflows.FILES_TINY.values())


def test_tau_and_aggregation_of_the_main_workflow():
    api = _load(REPO / "tests" / "workflows" / "sdvg_speculative_t2v.api.json")
    router = next(n for n in api.values() if n["class_type"] == "SDVGRewardRouter")["inputs"]
    assert router["tau"] == -0.7 and router["aggregation"] == "min" and router["mode"] == "reward"


# ----------------------------------------------------------------------------------------------- converter
INFO = {
    "Src": {"input": {"required": {"seed": ["INT", {"default": 0, "control_after_generate": True}], "name": [["a", "b"], {}]}},
            "input_order": {"required": ["seed", "name"]}, "output": ["IMAGE"]},
    "Dst": {"input": {"required": {"images": ["IMAGE", {}], "scale": ["FLOAT", {"default": 1.0}]}},
            "input_order": {"required": ["images", "scale"]}, "output": []},
}


def _wf(mode=0, values=None):
    return {"nodes": [
        {"id": 1, "type": "Src", "mode": mode, "widgets_values": values or [5, "randomize", "b"], "inputs": [], "outputs": []},
        {"id": 2, "type": "Dst", "mode": 0, "widgets_values": [2.0], "inputs": [{"name": "images", "link": 9}]},
        {"id": 3, "type": "Note", "mode": 0, "widgets_values": ["hello"]},
    ], "links": [[9, 1, 0, 2, 0, "IMAGE"]]}


def test_converter_skips_control_values_and_links_inputs():
    api = ui_to_api(_wf(), INFO)
    assert api == {
        "1": {"class_type": "Src", "inputs": {"seed": 5, "name": "b"}, "_meta": {"title": "Src"}},
        "2": {"class_type": "Dst", "inputs": {"scale": 2.0, "images": ["1", 0]}, "_meta": {"title": "Dst"}},
    }


def test_converter_errors():
    with pytest.raises(ConversionError, match="muted"):
        ui_to_api(_wf(mode=2), INFO)
    with pytest.raises(ConversionError, match="no value"):
        ui_to_api(_wf(values=[5]), INFO)
    with pytest.raises(ConversionError, match="unknown node type"):
        ui_to_api({"nodes": [{"id": 1, "type": "Nope"}], "links": []}, INFO)
