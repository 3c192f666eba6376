"""Checks on ``/object_info``-shaped node definitions, shared by the stub tests and the real-host tests."""

from __future__ import annotations

import math

OUR_TYPES = {"SDVG_DIT", "SDVG_TEXT_ENCODER", "SDVG_VAE", "SDVG_REWARD", "SDVG_CONDITIONING", "SDVG_ROUTER"}


def node_problems(name: str, info: dict) -> list[str]:
    problems = []
    if not name.startswith("SDVG"):
        problems.append(f"{name}: node id is not prefixed SDVG")
    if not str(info.get("category", "")).startswith("SDVG/"):
        problems.append(f"{name}: category {info.get('category')!r} is not under SDVG/")
    if not info.get("description"):
        problems.append(f"{name}: no description")
    for section in ("required", "optional"):
        for key, spec in (info["input"].get(section) or {}).items():
            type_slot, opts = spec[0], (spec[1] if len(spec) > 1 else {})
            where = f"{name}.{key}"
            if not opts.get("tooltip"):
                problems.append(f"{where}: no tooltip")
            default = opts.get("default")
            if isinstance(type_slot, list) or type_slot == "COMBO":
                choices = type_slot if isinstance(type_slot, list) else opts.get("options", [])
                if default is not None and choices and default not in choices:
                    problems.append(f"{where}: default {default!r} not among {choices}")
            elif type_slot in ("INT", "FLOAT"):
                lo, hi, step = opts.get("min"), opts.get("max"), opts.get("step")
                if default is None:
                    problems.append(f"{where}: numeric widget without a default")
                    continue
                if lo is not None and default < lo or hi is not None and default > hi:
                    problems.append(f"{where}: default {default} outside [{lo}, {hi}]")
                if type_slot == "INT" and step and lo is not None and (default - lo) % step:
                    problems.append(f"{where}: default {default} not on the step grid {lo}+k*{step}")
                if type_slot == "FLOAT" and not math.isfinite(default):
                    problems.append(f"{where}: non-finite default")
            elif type_slot in OUR_TYPES or type_slot.isupper():
                pass
            else:
                problems.append(f"{where}: unexpected type {type_slot!r}")
    if len(info.get("output", [])) != len(info.get("output_tooltips", [])) or not all(info.get("output_tooltips", [])):
        problems.append(f"{name}: every output needs a tooltip")
    return problems


def widget_inputs(info: dict) -> list[tuple[str, object, dict]]:
    """(name, type slot, options) of every widget input, in the order the frontend lays out widgets_values."""
    out = []
    for section in ("required", "optional"):
        for key in info.get("input_order", {}).get(section, list((info["input"].get(section) or {}).keys())):
            spec = info["input"][section][key]
            type_slot, opts = spec[0], (spec[1] if len(spec) > 1 else {})
            is_widget = isinstance(type_slot, list) or type_slot in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
            if is_widget and not opts.get("forceInput"):
                out.append((key, type_slot, opts))
    return out


def value_problems(where: str, type_slot, opts: dict, value) -> list[str]:
    if isinstance(type_slot, list) or type_slot == "COMBO":
        choices = type_slot if isinstance(type_slot, list) else opts.get("options", [])
        return [] if value in choices else [f"{where}: {value!r} not among {choices}"]
    if type_slot == "BOOLEAN":
        return [] if isinstance(value, bool) else [f"{where}: {value!r} is not a boolean"]
    if type_slot == "STRING":
        return [] if isinstance(value, str) else [f"{where}: {value!r} is not a string"]
    if type_slot in ("INT", "FLOAT"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return [f"{where}: {value!r} is not a number"]
        if type_slot == "INT" and not float(value).is_integer():
            return [f"{where}: {value!r} is not an integer"]
        lo, hi = opts.get("min"), opts.get("max")
        if lo is not None and value < lo or hi is not None and value > hi:
            return [f"{where}: {value} outside [{lo}, {hi}]"]
    return []
