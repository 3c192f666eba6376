"""ImageReward checkpoints → :class:`~.reward.ImageReward`: key map, config from shapes, file and vocab reading.

The official checkpoint (``ImageReward.pt``, THUDM) is a flat fp32 state dict of 625 tensors in the layout of the
original BLIP code (timm-style ViT + BLIP's ``med.py`` BERT). We map those names onto transformers'
``BlipVisionModel`` and ``BlipTextModel`` and load strictly. Architecture hyper-parameters are inferred from tensor
shapes; the only ones shapes cannot tell are the attention head counts (the real model: ``width // 64``). A
checkpoint whose heads differ (our tiny test model) stores them in a sidecar ``<stem>.config.json`` beside it, or in
the safetensors metadata key ``sdvg_image_reward_config``. The tokenizer is bert-base-uncased WordPiece read from a
local ``vocab.txt`` (never the hub).
"""

from __future__ import annotations

import collections
import inspect
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..devices import parse_dtype, resolve_device
from ..errors import ConfigError, ModelFileError
from ..models.reward import MAX_PROMPT_TOKENS, MLP_DIMS, ImageReward, ImageRewardConfig, build_modules
from .checkpoint import describe_keys, load_checkpoint, looks_like
from .file_checks import require_path

logger = logging.getLogger(__name__)

VISION_PREFIX = "blip.visual_encoder."
TEXT_PREFIX = "blip.text_encoder."
MLP_PREFIX = "mlp.layers."
# Keys of the official checkpoint that scoring never uses; exactly these are dropped before a strict load.
UNUSED_KEYS = frozenset(
    {
        "blip.text_encoder.embeddings.position_ids",
        "blip.vision_proj.weight",
        "blip.vision_proj.bias",
        "blip.text_proj.weight",
        "blip.text_proj.bias",
    }
)
OFFICIAL_NAME = "ImageReward.pt"
VOCAB_NAME = "vocab.txt"
TINY_NAME = "sdvg_tiny_image_reward.pt"
SAFETENSORS_CONFIG_KEY = "sdvg_image_reward_config"
BERT_VOCAB_LINES = 30522
VOCAB_HELP = (
    "ImageReward uses the bert-base-uncased WordPiece vocabulary: put its vocab.txt (30,522 lines, about 232 kB; "
    "from the Hugging Face repo google-bert/bert-base-uncased, file vocab.txt) beside the checkpoint, "
    "or pass vocab=<path>."
)

_VISION_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"^cls_token$", "embeddings.class_embedding"),
        (r"^pos_embed$", "embeddings.position_embedding"),
        (r"^patch_embed\.proj\.(weight|bias)$", r"embeddings.patch_embedding.\1"),
        (r"^blocks\.(\d+)\.norm1\.(weight|bias)$", r"encoder.layers.\1.layer_norm1.\2"),
        (r"^blocks\.(\d+)\.norm2\.(weight|bias)$", r"encoder.layers.\1.layer_norm2.\2"),
        (r"^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$", r"encoder.layers.\1.self_attn.qkv.\2"),
        (r"^blocks\.(\d+)\.attn\.proj\.(weight|bias)$", r"encoder.layers.\1.self_attn.projection.\2"),
        (r"^blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)$", r"encoder.layers.\1.mlp.\2.\3"),
        (r"^norm\.(weight|bias)$", r"post_layernorm.\1"),
    )
)


# --------------------------------------------------------------------------------------------------------------
# config from shapes


def _shape(shapes: Mapping[str, tuple[int, ...]], key: str, path: str) -> tuple[int, ...]:
    if key not in shapes:
        raise ModelFileError(f"{path}: ImageReward tensor {key!r} is missing; the checkpoint is incomplete.")
    return tuple(int(s) for s in shapes[key])


# (vision width, vision depth, text width, text layers) of the official ImageReward v1.0: BLIP ViT-L/16 + BERT-base,
# whose attention heads are 64 wide (16 and 12 heads); shapes cannot tell a head count, so only these get the default
OFFICIAL_SHAPES = (1024, 24, 768, 12)


def _check_heads_known(given: set[str], shapes: tuple[int, int, int, int], path: str) -> None:
    """The head counts come from the config (sidecar or metadata), or from the shapes when they are the official
    checkpoint's; any other checkpoint without them is refused (a guessed head count scores silently wrong)."""
    missing = {"vision_heads", "text_heads"} - given
    if not missing or shapes == OFFICIAL_SHAPES:
        return
    stem = Path(path).stem
    raise ModelFileError(
        f"{path}: an ImageReward checkpoint that is not the official one (vision {shapes[0]} wide × {shapes[1]} "
        f"layers, text {shapes[2]} wide × {shapes[3]} layers) and has no config giving {', '.join(sorted(missing))}: "
        "attention head counts cannot be read from the weights' shapes, and a guess scores silently wrong. Put "
        f"{stem}.config.json beside it, e.g. {{\"vision_heads\": {max(1, shapes[0] // 64)}, \"text_heads\": "
        f"{max(1, shapes[2] // 64)}}} with the counts it was trained with.")


def infer_config(
    shapes: Mapping[str, tuple[int, ...]], *, overrides: Mapping | None = None, path: str = "checkpoint"
) -> ImageRewardConfig:
    """Architecture from the official-layout tensor shapes; ``overrides`` may set the head counts."""
    v, t = VISION_PREFIX, TEXT_PREFIX
    width = _shape(shapes, v + "cls_token", path)[-1]
    patch_w = _shape(shapes, v + "patch_embed.proj.weight", path)
    patch = patch_w[-1]
    positions = _shape(shapes, v + "pos_embed", path)[1]
    grid = math.isqrt(positions - 1)
    if grid * grid != positions - 1 or patch_w[1] != 3:
        raise ModelFileError(f"{path}: pos_embed has {positions} positions, not 1 + a square grid of patches.")
    depth = 1 + max((int(m.group(1)) for k in shapes if (m := re.match(re.escape(v) + r"blocks\.(\d+)\.", k))),
                    default=-1)
    vision_inter = _shape(shapes, v + "blocks.0.mlp.fc1.weight", path)[0] if depth else 4 * width
    vocab, hidden = _shape(shapes, t + "embeddings.word_embeddings.weight", path)
    max_pos = _shape(shapes, t + "embeddings.position_embeddings.weight", path)[0]
    layers = 1 + max((int(m.group(1)) for k in shapes if (m := re.match(re.escape(t) + r"encoder\.layer\.(\d+)\.", k))),
                     default=-1)
    text_inter = _shape(shapes, t + "encoder.layer.0.intermediate.dense.weight", path)[0] if layers else 4 * hidden
    if hidden != MLP_DIMS[0]:
        raise ModelFileError(
            f"{path}: text hidden size is {hidden}, but ImageReward's MLP head takes {MLP_DIMS[0]} features."
        )
    heads = {"vision_heads": max(1, width // 64), "text_heads": max(1, hidden // 64)}
    heads.update(ImageRewardConfig.heads_from(overrides or {}))
    cfg = ImageRewardConfig(
        image_size=grid * patch,
        patch_size=patch,
        vision_width=width,
        vision_depth=depth,
        vision_heads=heads["vision_heads"],
        vision_intermediate=vision_inter,
        text_hidden=hidden,
        text_layers=layers,
        text_heads=heads["text_heads"],
        text_intermediate=text_inter,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
    )
    if width % cfg.vision_heads or hidden % cfg.text_heads:
        raise ModelFileError(f"{path}: head counts {heads} do not divide the widths ({width}, {hidden}).")
    if max_pos < MAX_PROMPT_TOKENS:
        raise ModelFileError(f"{path}: {max_pos} text positions, fewer than the {MAX_PROMPT_TOKENS} prompt tokens.")
    return cfg


# --------------------------------------------------------------------------------------------------------------
# key map


@dataclass
class MappedStateDict:
    vision: dict[str, torch.Tensor]
    text: dict[str, torch.Tensor]
    mlp: dict[str, torch.Tensor]
    dropped: list[str]
    unknown: list[str]


def map_official_keys(state: Mapping[str, torch.Tensor]) -> MappedStateDict:
    """Split an official-layout state dict into HF vision / HF text / MLP dicts (pure name mapping)."""
    out = MappedStateDict({}, {}, {}, [], [])
    for key, value in state.items():
        if key in UNUSED_KEYS:
            out.dropped.append(key)
        elif key.startswith(VISION_PREFIX):
            sub = key[len(VISION_PREFIX):]
            for pattern, repl in _VISION_RULES:
                if pattern.match(sub):
                    out.vision[pattern.sub(repl, sub)] = value
                    break
            else:
                out.unknown.append(key)
        elif key.startswith(TEXT_PREFIX):
            out.text[key[len(TEXT_PREFIX):]] = value
        elif key.startswith(MLP_PREFIX):
            out.mlp[key[len(MLP_PREFIX):]] = value
        else:
            out.unknown.append(key)
    return out


# --------------------------------------------------------------------------------------------------------------
# file reading


def _overrides(path: Path, metadata: Mapping[str, str]) -> dict:
    """Head counts from the safetensors metadata and the ``<stem>.config.json`` sidecar (the metadata wins)."""
    overrides: dict = {}
    if SAFETENSORS_CONFIG_KEY in metadata:
        try:
            overrides = json.loads(metadata[SAFETENSORS_CONFIG_KEY])
        except json.JSONDecodeError as exc:
            raise ModelFileError(f"{path}: metadata {SAFETENSORS_CONFIG_KEY} is not JSON ({exc}).") from exc
    sidecar = path.with_name(path.stem + ".config.json")
    if sidecar.is_file():
        try:
            overrides = {**json.loads(sidecar.read_text(encoding="utf-8")), **overrides}
        except json.JSONDecodeError as exc:
            raise ModelFileError(f"{sidecar}: not valid JSON ({exc}).") from exc
    return overrides


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and an optional config-override dict from ``.pt``/``.pth``/``.bin`` (weights_only) or ``.safetensors``."""
    require_path(path, f"ImageReward checkpoint not found: {path}. Download ImageReward.pt (THUDM/ImageReward on "
                       "Hugging Face, 1.79 GB) into models/image_reward/ and put bert-base-uncased's vocab.txt beside it.")
    if path.is_dir():
        raise ModelFileError(f"{path} is a folder, not an ImageReward checkpoint: pass the ImageReward.pt inside it.")
    ck = load_checkpoint(path)
    keys = list(ck.tensors)
    if not any(k.startswith(VISION_PREFIX) for k in keys) or not any(k.startswith(MLP_PREFIX) for k in keys):
        raise ModelFileError(
            f"{path} is not an ImageReward checkpoint: expected blip.visual_encoder.*, blip.text_encoder.* and "
            f"mlp.layers.* tensors, found {describe_keys(keys)}; it looks like {looks_like(keys, entry=ck.entry)}. "
            "Select ImageReward.pt (THUDM/ImageReward)."
        )
    return ck.tensors, _overrides(path, ck.metadata)


def read_vocab_lines(path: Path) -> list[str]:
    """The lines of a WordPiece vocab.txt (one token a line), refusing a missing, non-UTF-8 or empty file."""
    require_path(path, f"Tokenizer vocabulary not found: {path}. {VOCAB_HELP}")
    if path.is_dir():
        raise ModelFileError(f"The tokenizer vocabulary {path} is a folder; pass its vocab.txt. {VOCAB_HELP}")
    data = path.read_bytes()
    if not data:
        raise ModelFileError(f"{path}: this vocab.txt is empty (0 bytes; an interrupted download?). {VOCAB_HELP}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFileError(f"{path}: this vocab.txt is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                             f"{exc.start}), so it is not bert-base-uncased's. {VOCAB_HELP}") from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # as open(): universal newlines
    if lines[-1] == "":
        lines.pop()
    if not any(line.strip() for line in lines):
        raise ModelFileError(f"{path}: this vocab.txt is empty ({len(lines)} blank line{'s' * (len(lines) != 1)}, "
                             f"no tokens). {VOCAB_HELP}")
    return lines


def check_vocab_size(lines: list[str], vocab_path: Path, cfg: ImageRewardConfig, path: Path) -> None:
    """A vocab.txt has one line per word embedding of the checkpoint, less ImageReward's [DEC] and [ENC]."""
    want = cfg.vocab_size - 2
    if len(lines) == want:
        return
    if want == BERT_VOCAB_LINES:
        raise ModelFileError(f"{vocab_path}: this vocab.txt has {len(lines):,} lines, bert-base-uncased's has "
                             f"{BERT_VOCAB_LINES:,} (the vocabulary {path.name} was trained with). {VOCAB_HELP}")
    raise ModelFileError(
        f"{vocab_path}: this vocab.txt has {len(lines):,} lines, but {path.name} has {cfg.vocab_size:,} word "
        f"embeddings, so its vocabulary has {want:,} lines (+ [DEC], [ENC]); bert-base-uncased's has "
        f"{BERT_VOCAB_LINES:,}. Use the vocab.txt this checkpoint was made with."
    )


def load_tokenizer(vocab_path: Path, lines: list[str] | None = None):
    """bert-base-uncased style BertTokenizer from a local vocab.txt, plus ImageReward's [DEC] and [ENC] tokens."""
    from transformers import BertTokenizer

    lines = read_vocab_lines(vocab_path) if lines is None else lines
    if "vocab" in inspect.signature(BertTokenizer.__init__).parameters:  # transformers >= 5
        vocab = collections.OrderedDict((line, index) for index, line in enumerate(lines))
        tok = BertTokenizer(vocab=vocab, do_lower_case=True)
    else:  # transformers 4.x
        tok = BertTokenizer(vocab_file=str(vocab_path), do_lower_case=True)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


def _find_vocab(path: Path, vocab: str | Path | None) -> Path:
    if vocab is not None:
        return Path(vocab)
    own = path.with_name(path.stem + ".vocab.txt")
    return own if own.is_file() else path.with_name(VOCAB_NAME)


# --------------------------------------------------------------------------------------------------------------
# loading


def _assign(model: ImageReward, mapped: MappedStateDict, path: Path) -> None:
    for name, module, sub in (("vision", model.vision, mapped.vision), ("text", model.text, mapped.text),
                              ("mlp", model.mlp, mapped.mlp)):
        try:
            module.load_state_dict(sub, strict=True, assign=True)
        except RuntimeError as exc:
            raise ModelFileError(f"{path}: the {name} tensors do not match ImageReward v1.0 ({exc}).") from exc
    # non-persistent buffers are not in the checkpoint: recreate them off the meta device
    model.text.embeddings.position_ids = torch.arange(model.config.max_position_embeddings).expand((1, -1))
    leftovers = [n for n, t in model.named_buffers() if t.is_meta] + [
        n for n, t in model.named_parameters() if t.is_meta
    ]
    if leftovers:
        raise ModelFileError(f"{path}: tensors left uninitialized after loading: {leftovers[:5]}.")


def load_image_reward(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
    vocab: str | Path | None = None,
) -> ImageReward:
    """Load ``ImageReward.pt`` (or a safetensors copy with the same keys) strictly, tokenizer from vocab.txt.

    ``device``: "auto"/"cpu"/"cuda:N" or a torch.device. ``dtype``: float32 (reference), bfloat16 or float16 for the
    BLIP trunk ("auto" = float32); the MLP head always stays float32 (ImageReward casts the CLS feature to float
    before it). The tokenizer is ``vocab=`` or ``<stem>.vocab.txt`` or ``vocab.txt`` beside the checkpoint."""
    path = Path(path)
    target_device = resolve_device(device, what="ImageReward model")
    target_dtype = parse_dtype(dtype, default=torch.float32)
    if not isinstance(target_dtype, torch.dtype):
        raise ConfigError(f"ImageReward does not support {target_dtype} weights; use fp32, bf16 or fp16.")
    state, overrides = read_checkpoint(path)
    cfg = infer_config({k: tuple(v.shape) for k, v in state.items()}, overrides=overrides, path=str(path))
    vocab_path = _find_vocab(path, vocab)
    lines = read_vocab_lines(vocab_path)
    check_vocab_size(lines, vocab_path, cfg, path)
    tokenizer = load_tokenizer(vocab_path, lines)
    if len(tokenizer) != cfg.vocab_size:  # repeated lines
        raise ModelFileError(
            f"{vocab_path}: this vocab.txt has {len(lines):,} lines but only {len(tokenizer) - 2:,} distinct tokens "
            f"(some lines repeat), and {path.name} has {cfg.vocab_size:,} word embeddings. {VOCAB_HELP}"
        )
    mapped = map_official_keys(state)
    if mapped.unknown:
        raise ModelFileError(
            f"{path}: {len(mapped.unknown)} unexpected tensors for ImageReward v1.0, e.g. {mapped.unknown[:5]}."
        )
    with torch.device("meta"):
        vision, text = build_modules(cfg)
    model = ImageReward(cfg, tokenizer, vision=vision, text=text)
    _assign(model, mapped, path)
    _check_heads_known(set(ImageRewardConfig.heads_from(overrides)),
                       (cfg.vision_width, cfg.vision_depth, cfg.text_hidden, cfg.text_layers), str(path))
    model.to(device=target_device, dtype=target_dtype)
    model.mlp.float()
    model.eval()
    model.requires_grad_(False)
    logger.info("ImageReward loaded from %s: %s", path, cfg)
    return model
