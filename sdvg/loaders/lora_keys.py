"""What the keys of a Wan LoRA file mean: its layout (prefix + module spelling + factor suffix), the DiT parameter a
key changes, and the keys that are for something else (an I2V model's image layers, a text encoder).

Layouts (``FORMATS``), with their key prefixes:

* ComfyUI / kohya ``lora_unet_blocks_0_self_attn_q``; VideoX-Fun ``lora_unet__blocks_0_…`` (two underscores);
  SimpleTuner / ai-toolkit LyCORIS naming ``lycoris_blocks_0_self_attn_q`` (all ``lora_down``/``lora_up``/``alpha``);
* diffusers / PEFT ``transformer.blocks.0.attn1.to_q.lora_A.weight`` (alpha in ``lora_adapter_metadata``);
* original Wan keys ``diffusion_model.blocks.0.self_attn.q`` (also bare, and DiffSynth's ``lora_A.default``);
  DiffSynth / UniAnimate pipelines ``pipe.dit.blocks.0.self_attn.q``;
* full deltas ``.diff`` / ``.diff_b`` (CausVid / lightx2v) and WanVideoWrapper's ``.diff_m`` (the modulation
  table's delta: ``blocks.N.diff_m`` → ``blocks.N.modulation``, ``head.diff_m`` → ``head.modulation``).

Keys for parts a Wan 2.1 T2V DiT does not have are *skippable* (``skip_reason``): text-encoder keys (a diffusers
file trained with the text encoder) and image-to-video keys (``k_img``, ``v_img``, ``img_emb``…: an I2V LoRA on a
T2V model). The reader skips those with a warning naming them (ComfyUI applies the matching part too) unless asked
to be strict; any other key that matches nothing is an error.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .wan_keys import diffusers_to_original_key

# key prefixes, longest first (the underscore layouts have no dot: module names follow with "_" for ".")
PREFIXES = ("base_model.model.diffusion_model.", "model.diffusion_model.", "base_model.model.", "diffusion_model.",
            "transformer.", "pipe.dit.", "lora_transformer_", "lora_unet__", "lora_unet_", "lycoris_", "")
# key suffix → the part it is
SUFFIXES = (
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora_B.bias", "diff_b"),
    (".alpha", "alpha"), (".diff_b", "diff_b"), (".diff_m", "diff_m"), (".diff", "diff"),
)
UNSUPPORTED = re.compile(r"lora_mid|hada_|lokr_|dora_scale|\.w[12]_[ab]|magnitude_vector")
FORMATS = {
    "kohya": "ComfyUI/kohya (lora_unet_…, lora_down/lora_up/alpha)",
    "videox-fun": "VideoX-Fun (lora_unet__…, lora_down/lora_up/alpha)",
    "lycoris": "SimpleTuner/ai-toolkit LyCORIS naming (lycoris_…, lora_down/lora_up/alpha)",
    "diffusers": "diffusers/PEFT (transformer.…, lora_A/lora_B)",
    "diffsynth": "DiffSynth/UniAnimate pipeline (pipe.dit.…)",
    "original": "original Wan keys (diffusion_model.…)",
}
KNOWN_WIDTHS = {1536: "Wan 2.1 1.3B", 5120: "Wan 2.1 14B"}
TEXT_ENCODER = re.compile(r"^(lora_te\d?_|text_encoders?[._]|te[12]?\.|cond_stage_model\.|umt5|t5[._]|"
                          r"(base_model\.model\.)?(encoder|shared)\.)")
I2V = re.compile(r"k_img|v_img|norm_k_img|img_emb|image_embedder|add_k_proj|add_v_proj|clip_feature")
SKIP_REASONS = {
    "text-encoder": "text-encoder keys (SDVG's LoRAs change the DiT; the text encoder is not patched)",
    "i2v": "image-to-video (I2V) layers, which a text-to-video DiT does not have",
}


def split_key(key: str) -> tuple[str, str, str] | None:
    """→ (prefix, module, part) or None when the key is no LoRA key we know. ``.diff_m`` is the delta of the
    module's ``modulation`` parameter (part ``diff``)."""
    found = next(((key[: -len(suffix)], part) for suffix, part in SUFFIXES if key.endswith(suffix)), None)
    if found is None:
        return None
    stem, part = found
    if part == "diff_m":
        stem, part = stem + ".modulation", "diff"
    for prefix in PREFIXES:
        if stem.startswith(prefix):
            return prefix, stem[len(prefix):], part
    return None  # pragma: no cover - "" always matches


def skip_reason(key: str) -> str | None:
    """``"text-encoder"`` / ``"i2v"`` for a key a T2V DiT has no place for, else None."""
    if TEXT_ENCODER.search(key):
        return "text-encoder"
    if I2V.search(key):
        return "i2v"
    return None


def name_table(param_shapes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Every spelling of a module or parameter (diffusers, original, both with '_' for '.') → diffusers name
    (a module's ``.weight`` dropped; a bare parameter such as ``scale_shift_table`` kept whole)."""
    table: dict[str, str] = {}
    for key in param_shapes:
        name = key[: -len(".weight")] if key.endswith(".weight") else key
        if key.endswith(".bias"):
            continue
        original = diffusers_to_original_key(key)
        original = original[: -len(".weight")] if original.endswith(".weight") else original
        for spelling in (name, original):
            table.setdefault(spelling, name)
            table.setdefault(spelling.replace(".", "_"), name)
    return table


def format_of(prefixes: Counter, modules: Iterable[str]) -> str:
    prefix = prefixes.most_common(1)[0][0] if prefixes else ""
    by_prefix = {"lora_unet__": "videox-fun", "lycoris_": "lycoris", "pipe.dit.": "diffsynth"}
    if prefix in by_prefix:
        return by_prefix[prefix]
    if prefix.startswith("lora_"):
        return "kohya"
    if prefix in ("transformer.", "base_model.model.") or any(".attn1." in m or m.startswith("blocks.") and ".to_q" in m
                                                            for m in modules):
        return "diffusers"
    return "original"


def scan(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What a LoRA's keys and factor shapes say, without matching them to a model."""
    prefixes: Counter = Counter()
    modules: set[str] = set()
    ranks: Counter = Counter()
    skipped: dict[str, list[str]] = {}
    width, blocks, diffs = None, set(), 0
    for key, tensor in tensors.items():
        reason = skip_reason(key)
        if reason:
            skipped.setdefault(reason, []).append(key)
        split = split_key(key)
        if split is None or reason:
            continue
        prefix, module, part = split
        prefixes[prefix] += 1
        modules.add(module)
        if m := re.match(r"blocks[._](\d+)[._]", module):
            blocks.add(int(m.group(1)))
        if part == "down":
            ranks[int(tensor.shape[0])] += 1
        diffs += part in ("diff", "diff_b")
        if width is None and part in ("down", "diff") and re.search(r"(self_attn|attn1)[._](to_)?[qk]$", module):
            width = int(tensor.flatten(1).shape[1])
    return {"prefixes": prefixes, "modules": modules, "ranks": ranks, "width": width,
            "blocks": max(blocks) + 1 if blocks else 0, "diffs": diffs, "skipped": skipped}


def made_for(info: dict[str, Any]) -> str:
    width = info["width"]
    text = f"width {width} ({KNOWN_WIDTHS.get(width, 'custom')})" if width else "unknown width"
    return text + (f", {info['blocks']} blocks" if info["blocks"] else "")
