"""Convert a UI-format workflow (what the frontend saves) into the API format ``POST /prompt`` accepts.

Needs the node definitions in ``/object_info`` shape (ours from the schemas, core ones from
``core_nodes.CORE_NODES`` or a live server). Rules, as the frontend applies them:
* frontend-only nodes (Note, MarkdownNote) and muted (mode 2) or bypassed (mode 4) nodes are left out;
* ``widgets_values`` is positional over the widget inputs (required, then optional, in ``input_order``), with one
  extra value after every widget that has ``control_after_generate`` ("fixed", "randomize", ...);
* a linked input (socket or converted widget) becomes ``[source_node_id, output_slot]`` and wins over a widget value.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

try:
    from .core_nodes import VIRTUAL_NODES
    from .schema_checks import widget_inputs
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from core_nodes import VIRTUAL_NODES  # type: ignore[no-redef]
    from schema_checks import widget_inputs  # type: ignore[no-redef]

SKIPPED_MODES = (2, 4)


class ConversionError(ValueError):
    pass


def widget_values(node: dict, info: dict) -> dict:
    values = node.get("widgets_values") or []
    if isinstance(values, dict):  # some packs save a name → value map
        return dict(values)
    out, i = {}, 0
    for name, _type_slot, opts in widget_inputs(info):
        if i >= len(values):
            raise ConversionError(f"node {node['id']} ({node['type']}): no value for widget '{name}' in {values}")
        out[name] = values[i]
        i += 1
        if opts.get("control_after_generate"):
            i += 1
    if i != len(values):
        raise ConversionError(f"node {node['id']} ({node['type']}): {len(values)} widget values, expected {i}")
    return out


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link for link in workflow.get("links", [])}
    prompt: dict[str, dict] = {}
    for node_id in sorted(nodes):
        node = nodes[node_id]
        if node["type"] in VIRTUAL_NODES or node.get("mode", 0) in SKIPPED_MODES:
            continue
        if node["type"] not in object_info:
            raise ConversionError(f"node {node_id}: unknown node type {node['type']!r}")
        inputs = widget_values(node, object_info[node["type"]])
        for slot in node.get("inputs") or []:
            link_id = slot.get("link")
            if link_id is None:
                continue
            _id, src, src_slot, dst, _dst_slot, _type = links[link_id]
            if dst != node_id:
                raise ConversionError(f"link {link_id} does not end at node {node_id}")
            if nodes[src].get("mode", 0) in SKIPPED_MODES or nodes[src]["type"] in VIRTUAL_NODES:
                raise ConversionError(f"node {node_id} input '{slot['name']}' comes from a muted/virtual node")
            inputs[slot["name"]] = [str(src), src_slot]
        prompt[str(node_id)] = {
            "class_type": node["type"],
            "inputs": inputs,
            "_meta": {"title": node.get("title") or node["type"]},
        }
    return prompt


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: ui_to_api.py WORKFLOW.json OBJECT_INFO.json > API.json\n")
        return 2
    workflow = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    object_info = json.loads(Path(argv[2]).read_text(encoding="utf-8"))
    sys.stdout.write(json.dumps(ui_to_api(workflow, object_info), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
