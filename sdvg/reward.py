"""ImageReward v1.0 verifier on transformers' BLIP classes plus our own MLP head.

The official checkpoint (``ImageReward.pt``, THUDM) is a flat fp32 state dict of 625 tensors in the layout of the
original BLIP code (timm-style ViT + BLIP's ``med.py`` BERT). We map those names onto transformers'
``BlipVisionModel`` and ``BlipTextModel`` (built with ``is_decoder=True`` so every layer has cross-attention, run
with ``is_decoder=False`` so self-attention is bidirectional, as in BLIP's "multimodal" mode), load strictly, and
score every frame of a block in one batched forward:

    reward = (MLP(text_cls(prompt | image tokens)) - 0.16717362830052426) / 1.0333394966054072

Frames use the ComfyUI IMAGE layout ``[N, H, W, 3]`` float in ``[0, 1]``. Preprocessing is done on tensors (no
torchvision, no PIL): bicubic antialiased resize of the short side to the model image size, center crop, CLIP
mean/std. The tokenizer is bert-base-uncased WordPiece read from a local ``vocab.txt`` (never the hub), with the
``[DEC]``/``[ENC]`` tokens ImageReward adds, prompts padded/truncated to 35 tokens.

Model architecture hyper-parameters are inferred from tensor shapes. The only ones shapes cannot tell are the
attention head counts; the real model uses ``width // 64`` (16 vision heads, 12 text heads). A checkpoint whose
heads differ (our tiny test model) stores them in a sidecar ``<stem>.config.json`` beside it, or in the
safetensors metadata key ``sdvg_image_reward_config``.
"""

from __future__ import annotations

import collections
import inspect
import json
import logging
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .devices import parse_dtype, resolve_device
from .errors import ConfigError, ModelFileError

logger = logging.getLogger(__name__)

REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_PROMPT_TOKENS = 35
VISION_LN_EPS = 1e-6
TEXT_LN_EPS = 1e-12
MLP_DIMS = (768, 1024, 128, 64, 16, 1)
MLP_LINEAR_INDICES = (0, 2, 4, 6, 7)
# Range tolerance for frames: values a hair outside [0, 1] (fp16 rounding) are clamped, not refused.
RANGE_EPS = 1e-3

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
# configuration


@dataclass(frozen=True)
class ImageRewardConfig:
    """Architecture of one ImageReward checkpoint (defaults: the real v1.0 model)."""

    image_size: int = 224
    patch_size: int = 16
    vision_width: int = 1024
    vision_depth: int = 24
    vision_heads: int = 16
    vision_intermediate: int = 4096
    text_hidden: int = 768
    text_layers: int = 12
    text_heads: int = 12
    text_intermediate: int = 3072
    vocab_size: int = 30524
    max_position_embeddings: int = 512

    def vision_config(self):
        from transformers import BlipVisionConfig

        return BlipVisionConfig(
            hidden_size=self.vision_width,
            intermediate_size=self.vision_intermediate,
            num_hidden_layers=self.vision_depth,
            num_attention_heads=self.vision_heads,
            image_size=self.image_size,
            patch_size=self.patch_size,
            layer_norm_eps=VISION_LN_EPS,
            hidden_act="gelu",
            attention_dropout=0.0,
        )

    def text_config(self):
        from transformers import BlipTextConfig

        return BlipTextConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.text_hidden,
            encoder_hidden_size=self.vision_width,
            intermediate_size=self.text_intermediate,
            num_hidden_layers=self.text_layers,
            num_attention_heads=self.text_heads,
            max_position_embeddings=self.max_position_embeddings,
            layer_norm_eps=TEXT_LN_EPS,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            is_decoder=True,  # creates the cross-attention modules; the forward runs bidirectionally
            use_cache=False,
            pad_token_id=0,
            bos_token_id=self.vocab_size - 2 if self.vocab_size >= 2 else None,
            sep_token_id=None,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def heads_from(cls, data: Mapping) -> dict[str, int]:
        known = {"vision_heads", "text_heads"}
        out: dict[str, int] = {}
        for key in known & set(data):
            value = data[key]
            if not isinstance(value, int) or value <= 0:
                raise ModelFileError(f"ImageReward config value {key}={value!r} must be a positive integer.")
            out[key] = value
        return out


def _shape(shapes: Mapping[str, tuple[int, ...]], key: str, path: str) -> tuple[int, ...]:
    if key not in shapes:
        raise ModelFileError(f"{path}: ImageReward tensor {key!r} is missing; the checkpoint is incomplete.")
    return tuple(int(s) for s in shapes[key])


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


def build_mlp() -> nn.Sequential:
    """768→1024→128→64→16→1, no activations; Dropouts at 1, 3, 5 keep the official indices 0, 2, 4, 6, 7."""
    d = MLP_DIMS
    return nn.Sequential(
        nn.Linear(d[0], d[1]), nn.Dropout(0.0),
        nn.Linear(d[1], d[2]), nn.Dropout(0.0),
        nn.Linear(d[2], d[3]), nn.Dropout(0.0),
        nn.Linear(d[3], d[4]),
        nn.Linear(d[4], d[5]),
    )  # fmt: skip


def build_modules(cfg: ImageRewardConfig):
    """(BlipVisionModel, BlipTextModel) for ``cfg`` on the current default device (use meta for shells)."""
    from transformers import BlipTextModel, BlipVisionModel

    vision = BlipVisionModel(cfg.vision_config())
    text = BlipTextModel(cfg.text_config(), add_pooling_layer=False)
    return vision, text


# --------------------------------------------------------------------------------------------------------------
# file reading


def _describe_keys(keys: list[str]) -> str:
    prefixes = collections.Counter(".".join(k.split(".")[:2]) for k in keys)
    top = ", ".join(f"{p}.* ({n})" for p, n in prefixes.most_common(5))
    return f"{len(keys)} tensors; top key prefixes: {top or 'none'}"


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and an optional config-override dict from ``.pt``/``.pth``/``.bin`` (weights_only) or ``.safetensors``."""
    if not path.is_file():
        raise ModelFileError(
            f"ImageReward checkpoint not found: {path}. Download ImageReward.pt (THUDM/ImageReward on Hugging Face, "
            "1.79 GB) into models/image_reward/ and put bert-base-uncased's vocab.txt beside it."
        )
    overrides: dict = {}
    if path.suffix.lower() == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                state = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFileError(f"{path}: not a readable safetensors file ({exc}).") from exc
        if SAFETENSORS_CONFIG_KEY in meta:
            try:
                overrides = json.loads(meta[SAFETENSORS_CONFIG_KEY])
            except json.JSONDecodeError as exc:
                raise ModelFileError(f"{path}: metadata {SAFETENSORS_CONFIG_KEY} is not JSON ({exc}).") from exc
    else:
        try:
            try:  # mmap keeps the 1.8 GB file out of anonymous memory; legacy (non-zip) pickles cannot mmap
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # UnpicklingError, RuntimeError (zip), EOFError ...
            raise ModelFileError(
                f"{path}: cannot be read as a plain tensor state dict with torch.load(weights_only=True) ({exc}). "
                "Use the official ImageReward.pt or a safetensors conversion."
            ) from exc
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ModelFileError(f"{path}: expected a flat dict of tensors (ImageReward.pt), found {type(state)}.")
        state = dict(state)
    sidecar = path.with_name(path.stem + ".config.json")
    if sidecar.is_file():
        try:
            overrides = {**json.loads(sidecar.read_text(encoding="utf-8")), **overrides}
        except json.JSONDecodeError as exc:
            raise ModelFileError(f"{sidecar}: not valid JSON ({exc}).") from exc
    keys = list(state)
    if not any(k.startswith(VISION_PREFIX) for k in keys) or not any(k.startswith(MLP_PREFIX) for k in keys):
        raise ModelFileError(
            f"{path} is not an ImageReward checkpoint: expected blip.visual_encoder.*, blip.text_encoder.* and "
            f"mlp.layers.* tensors, found {_describe_keys(keys)}. Select ImageReward.pt (THUDM/ImageReward)."
        )
    return state, overrides


def _read_vocab(path: Path) -> collections.OrderedDict[str, int]:
    vocab: collections.OrderedDict[str, int] = collections.OrderedDict()
    with path.open("r", encoding="utf-8") as fh:
        for index, line in enumerate(fh):
            vocab[line.rstrip("\n")] = index
    return vocab


def load_tokenizer(vocab_path: Path):
    """bert-base-uncased style BertTokenizer from a local vocab.txt, plus ImageReward's [DEC] and [ENC] tokens."""
    from transformers import BertTokenizer

    if not vocab_path.is_file():
        raise ModelFileError(f"Tokenizer vocabulary not found: {vocab_path}. {VOCAB_HELP}")
    if "vocab" in inspect.signature(BertTokenizer.__init__).parameters:  # transformers >= 5
        tok = BertTokenizer(vocab=_read_vocab(vocab_path), do_lower_case=True)
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


CHECKPOINT_CANDIDATES = (OFFICIAL_NAME, "ImageReward.safetensors", "model.safetensors", TINY_NAME)


def find_checkpoint(folder: str | Path) -> Path:
    """The ImageReward file in a folder (e.g. ``models/image_reward``): official names first, then our tiny one."""
    folder = Path(folder)
    for name in CHECKPOINT_CANDIDATES:
        if (folder / name).is_file():
            return folder / name
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise ModelFileError(
        f"No ImageReward checkpoint in {folder} (looked for {', '.join(CHECKPOINT_CANDIDATES)}; found "
        f"{found[:10] or 'nothing'}). Download ImageReward.pt (THUDM/ImageReward) and bert-base-uncased's "
        "vocab.txt into that folder."
    )


# --------------------------------------------------------------------------------------------------------------
# model


@dataclass(frozen=True)
class PreparedPrompt:
    text: str
    input_ids: torch.Tensor  # [1, 35] int64 on the model device
    attention_mask: torch.Tensor  # [1, 35]


class ImageReward(nn.Module):
    """ImageReward v1.0 scorer. Build with :meth:`load`; call :meth:`score`."""

    def __init__(self, config: ImageRewardConfig, tokenizer=None, *, vision=None, text=None):
        super().__init__()
        self.config = config
        if vision is None or text is None:
            vision, text = build_modules(config)
        self.vision = vision
        self.text = text
        self.mlp = build_mlp()
        self.tokenizer = tokenizer
        self._prompts: dict[str, PreparedPrompt] = {}
        self.eval()
        self.requires_grad_(False)

    # ---- loading -------------------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        vocab: str | Path | None = None,
    ) -> ImageReward:
        """Load ``ImageReward.pt`` (or a safetensors copy with the same keys) strictly, tokenizer from vocab.txt.

        ``device``: "auto"/"cpu"/"cuda:N" or a torch.device. ``dtype``: float32 (reference), bfloat16 or float16
        for the BLIP trunk ("auto" = float32); the MLP head always stays float32 (ImageReward casts the CLS
        feature to float before it). The tokenizer is ``vocab=`` or ``<stem>.vocab.txt`` or ``vocab.txt``
        beside the checkpoint.
        """
        path = Path(path)
        target_device = resolve_device(device, what="ImageReward model")
        target_dtype = parse_dtype(dtype, default=torch.float32)
        if not isinstance(target_dtype, torch.dtype):
            raise ConfigError(f"ImageReward does not support {target_dtype} weights; use fp32, bf16 or fp16.")
        state, overrides = read_checkpoint(path)
        cfg = infer_config({k: tuple(v.shape) for k, v in state.items()}, overrides=overrides, path=str(path))
        tokenizer = load_tokenizer(_find_vocab(path, vocab))
        if len(tokenizer) != cfg.vocab_size:
            raise ModelFileError(
                f"Vocabulary mismatch: the tokenizer has {len(tokenizer)} tokens ({len(tokenizer) - 2} from vocab.txt "
                f"+ [DEC], [ENC]) but {path.name} has {cfg.vocab_size} word embeddings. {VOCAB_HELP}"
            )
        mapped = map_official_keys(state)
        if mapped.unknown:
            raise ModelFileError(
                f"{path}: {len(mapped.unknown)} unexpected tensors for ImageReward v1.0, e.g. {mapped.unknown[:5]}."
            )
        with torch.device("meta"):
            vision, text = build_modules(cfg)
        model = cls(cfg, tokenizer, vision=vision, text=text)
        for name, module, sub in (("vision", vision, mapped.vision), ("text", text, mapped.text),
                                  ("mlp", model.mlp, mapped.mlp)):
            try:
                module.load_state_dict(sub, strict=True, assign=True)
            except RuntimeError as exc:
                raise ModelFileError(f"{path}: the {name} tensors do not match ImageReward v1.0 ({exc}).") from exc
        # non-persistent buffers are not in the checkpoint: recreate them off the meta device
        emb = text.embeddings
        emb.position_ids = torch.arange(cfg.max_position_embeddings).expand((1, -1))
        leftovers = [n for n, t in model.named_buffers() if t.is_meta] + [
            n for n, t in model.named_parameters() if t.is_meta
        ]
        if leftovers:
            raise ModelFileError(f"{path}: tensors left uninitialized after loading: {leftovers[:5]}.")
        model.to(device=target_device, dtype=target_dtype)
        model.mlp.float()
        model.eval()
        model.requires_grad_(False)
        logger.info("ImageReward loaded from %s: %s", path, cfg)
        return model

    @property
    def device(self) -> torch.device:
        return self.vision.embeddings.class_embedding.device

    @property
    def dtype(self) -> torch.dtype:
        return self.vision.embeddings.class_embedding.dtype

    # ---- prompt --------------------------------------------------------------------------------------------
    def prepare_prompt(self, text: str) -> PreparedPrompt:
        """Tokenize once per distinct text (cached): padded and truncated to 35 tokens incl. [CLS]/[SEP]."""
        if not isinstance(text, str):
            raise ConfigError(f"The ImageReward prompt must be a string, got {type(text).__name__}.")
        cached = self._prompts.get(text)
        if cached is not None and cached.input_ids.device == self.device:
            return cached
        if self.tokenizer is None:
            raise ConfigError("This ImageReward has no tokenizer; build it with ImageReward.load(...).")
        enc = self.tokenizer(
            text, padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt"
        )
        prepared = PreparedPrompt(
            text=text,
            input_ids=enc["input_ids"].to(self.device),
            attention_mask=enc["attention_mask"].to(self.device),
        )
        self._prompts[text] = prepared
        return prepared

    # ---- frames --------------------------------------------------------------------------------------------
    @staticmethod
    def validate_frames(frames: torch.Tensor) -> None:
        if not isinstance(frames, torch.Tensor):
            raise ConfigError(f"ImageReward frames must be a torch.Tensor [N,H,W,3], got {type(frames).__name__}.")
        if frames.dim() != 4 or frames.shape[-1] != 3:
            raise ConfigError(
                f"ImageReward frames must have shape [N, H, W, 3] (ComfyUI IMAGE), got {list(frames.shape)}."
            )
        if frames.shape[0] == 0 or frames.shape[1] == 0 or frames.shape[2] == 0:
            raise ConfigError(f"ImageReward got an empty frame batch {list(frames.shape)}.")
        if not frames.is_floating_point():
            hint = " Divide by 255 (frames.float() / 255) first." if frames.dtype == torch.uint8 else ""
            raise ConfigError(f"ImageReward frames must be floating point in [0, 1], got dtype {frames.dtype}.{hint}")
        finite, lo, hi = torch.stack(
            [torch.isfinite(frames).all().float(), frames.min().float(), frames.max().float()]
        ).tolist()
        if not finite:
            raise ConfigError("ImageReward frames contain NaN or inf values; the decoder output is broken.")
        if lo < -RANGE_EPS or hi > 1.0 + RANGE_EPS:
            hint = " They look like 0..255 values: divide by 255." if hi > 2.0 and lo >= 0 else ""
            hint = hint or (" They look like [-1, 1] values: use (x + 1) / 2." if lo < 0 else "")
            raise ConfigError(f"ImageReward frames must be in [0, 1], got min {lo:.4g}, max {hi:.4g}.{hint}")

    def preprocess(self, frames: torch.Tensor) -> torch.Tensor:
        """[N,H,W,3] in [0,1] → [N,3,S,S] CLIP-normalized float32 on the model device (BICUBIC short side, crop)."""
        size = self.config.image_size
        x = frames.to(device=self.device, dtype=torch.float32).permute(0, 3, 1, 2)
        h, w = x.shape[-2:]
        if h <= w:
            nh, nw = size, int(size * w / h)
        else:
            nh, nw = int(size * h / w), size
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp(0.0, 1.0)
        top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
        x = x[..., top : top + size, left : left + size]
        mean = x.new_tensor(CLIP_MEAN).view(1, 3, 1, 1)
        std = x.new_tensor(CLIP_STD).view(1, 3, 1, 1)
        return ((x - mean) / std).contiguous()

    # ---- scoring -------------------------------------------------------------------------------------------
    def score_pixels(self, pixels: torch.Tensor, prompt: PreparedPrompt) -> torch.Tensor:
        """Preprocessed ``[N,3,S,S]`` → rewards ``[N]`` float32 on the model device, one forward."""
        with torch.inference_mode():
            n = pixels.shape[0]
            image = self.vision(pixel_values=pixels.to(self.dtype)).last_hidden_state
            ids = prompt.input_ids.expand(n, -1)
            mask = prompt.attention_mask.expand(n, -1)
            hidden = self.text(
                input_ids=ids, attention_mask=mask, encoder_hidden_states=image, is_decoder=False
            ).last_hidden_state
            r = self.mlp(hidden[:, 0, :].float())
            return ((r - REWARD_MEAN) / REWARD_STD).squeeze(-1)

    def score_chunks(
        self, frames: torch.Tensor, prompt: str | PreparedPrompt, chunk_size: int | None = None
    ) -> Iterator[torch.Tensor]:
        """Yield per-chunk rewards (float32, CPU) in frame order; lets a router stop early."""
        self.validate_frames(frames)
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ConfigError(f"chunk_size must be a positive integer or None, got {chunk_size!r}.")
        prepared = prompt if isinstance(prompt, PreparedPrompt) else self.prepare_prompt(prompt)
        n = frames.shape[0]
        step = n if chunk_size is None else chunk_size
        for start in range(0, n, step):
            with torch.inference_mode():  # entered per chunk: never held across a yield
                pixels = self.preprocess(frames[start : start + step])
                chunk = self.score_pixels(pixels, prepared).to("cpu", torch.float32)
            yield chunk

    def score(
        self, frames: torch.Tensor, prompt: str | PreparedPrompt, *, chunk_size: int | None = None
    ) -> torch.Tensor:
        """ImageReward of each frame: ``[N]`` float32 on CPU. All frames go through one forward by default."""
        return torch.cat(list(self.score_chunks(frames, prompt, chunk_size)))



# --------------------------------------------------------------------------------------------------------------
# tiny random-weight model for tests (written in the ORIGINAL official key layout)

TINY_CONFIG = ImageRewardConfig(
    image_size=32,
    patch_size=16,
    vision_width=64,
    vision_depth=2,
    vision_heads=2,
    vision_intermediate=128,
    text_hidden=768,
    text_layers=1,
    text_heads=12,
    text_intermediate=32,
    vocab_size=0,  # set from the vocabulary below
    max_position_embeddings=40,
)
TINY_WORDS = (
    "a an the of in on with and at to is cat dog man woman girl boy city street car red blue green "
    "sunset forest river mountain beach ocean snow night light photo painting portrait walking running "
    "standing sitting big small old young cinematic detailed"
).split()
TINY_PIECES = tuple("abcdefghijklmnopqrstuvwxyz0123456789.,!?-'") + tuple(
    "##" + c for c in "abcdefghijklmnopqrstuvwxyz"
) + ("##s", "##ing", "##ed")


def tiny_vocab() -> list[str]:
    seen: dict[str, None] = {}
    for tok in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *TINY_WORDS, *TINY_PIECES):
        seen.setdefault(tok, None)
    return list(seen)


def tiny_official_state_dict(cfg: ImageRewardConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for ``cfg`` in the official ImageReward.pt layout (incl. the unused keys)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):  # shapes only
        vision, text = build_modules(cfg)
        mlp = build_mlp()
    out: dict[str, torch.Tensor] = {}

    def rnd(t: torch.Tensor, std: float) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen) * std

    inverse = {
        "embeddings.class_embedding": "cls_token",
        "embeddings.position_embedding": "pos_embed",
    }
    for name, t in vision.state_dict().items():
        if name in inverse:
            key = inverse[name]
        else:
            key = name.replace("embeddings.patch_embedding.", "patch_embed.proj.")
            key = re.sub(r"^encoder\.layers\.(\d+)\.layer_norm1\.", r"blocks.\1.norm1.", key)
            key = re.sub(r"^encoder\.layers\.(\d+)\.layer_norm2\.", r"blocks.\1.norm2.", key)
            key = re.sub(r"^encoder\.layers\.(\d+)\.self_attn\.projection\.", r"blocks.\1.attn.proj.", key)
            key = re.sub(r"^encoder\.layers\.(\d+)\.self_attn\.", r"blocks.\1.attn.", key)
            key = re.sub(r"^encoder\.layers\.(\d+)\.mlp\.", r"blocks.\1.mlp.", key)
            key = key.replace("post_layernorm.", "norm.")
        is_norm = "norm" in key and key.endswith("weight")
        out[VISION_PREFIX + key] = 1.0 + rnd(t, 0.05) if is_norm else rnd(t, 0.2 if t.dim() > 1 else 0.05)
    for name, t in text.state_dict().items():
        is_norm = "LayerNorm" in name and name.endswith("weight")
        out[TEXT_PREFIX + name] = 1.0 + rnd(t, 0.05) if is_norm else rnd(t, 0.05 if t.dim() > 1 else 0.02)
    out[TEXT_PREFIX + "embeddings.position_ids"] = torch.arange(cfg.max_position_embeddings).expand((1, -1)).clone()
    for name, t in mlp.state_dict().items():
        fan_in = t.shape[-1]
        out[MLP_PREFIX + name] = rnd(t, 1.0 / math.sqrt(fan_in)) if t.dim() > 1 else rnd(t, 0.1)
    # unused projections (present in the real file, 256-d)
    out["blip.vision_proj.weight"] = rnd(torch.empty(256 // 8, cfg.vision_width), 0.02)
    out["blip.vision_proj.bias"] = torch.zeros(256 // 8)
    out["blip.text_proj.weight"] = rnd(torch.empty(256 // 8, cfg.text_hidden), 0.02)
    out["blip.text_proj.bias"] = torch.zeros(256 // 8)
    return {k: v.contiguous() for k, v in out.items()}


def write_tiny_image_reward(models_dir: str | Path, *, seed: int = 0) -> Path:
    """Write ``models_dir/image_reward/sdvg_tiny_image_reward.pt`` (+ ``.vocab.txt`` and ``.config.json``).

    The .pt is a flat state dict in the original ImageReward.pt key layout, scaled down (vision width 64, depth 2,
    2 heads, 32×32 images; text 1 layer of width 768 (forced by the MLP), intermediate 32, ~100-token vocab),
    random deterministic weights including a non-degenerate MLP. About 18 MB.
    """
    folder = Path(models_dir) / "image_reward"
    folder.mkdir(parents=True, exist_ok=True)
    vocab = tiny_vocab()
    cfg = ImageRewardConfig(**{**{f.name: getattr(TINY_CONFIG, f.name) for f in fields(TINY_CONFIG)},
                               "vocab_size": len(vocab) + 2})
    state = tiny_official_state_dict(cfg, seed=seed)
    path = folder / TINY_NAME
    torch.save(state, path)
    path.with_name(path.stem + ".vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    path.with_name(path.stem + ".config.json").write_text(
        json.dumps({"vision_heads": cfg.vision_heads, "text_heads": cfg.text_heads, "note": "sdvg tiny test model"})
        + "\n",
        encoding="utf-8",
    )
    return path
