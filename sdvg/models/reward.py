"""ImageReward v1.0 verifier on transformers' BLIP classes plus our own MLP head.

Built on transformers' ``BlipVisionModel`` and ``BlipTextModel`` (``is_decoder=True`` so every text layer has
cross-attention, run with ``is_decoder=False`` so self-attention is bidirectional, as in BLIP's "multimodal" mode),
scoring every frame of a block in one batched forward:

    reward = (MLP(text_cls(prompt | image tokens)) - 0.16717362830052426) / 1.0333394966054072

Frames use the ComfyUI IMAGE layout ``[N, H, W, 3]`` float in ``[0, 1]``. Preprocessing is done on tensors (no
torchvision, no PIL): bicubic antialiased resize of the short side to the model image size, center crop, CLIP
mean/std. The tokenizer is bert-base-uncased WordPiece read from a local ``vocab.txt`` (never the hub), with the
``[DEC]``/``[ENC]`` tokens ImageReward adds, prompts padded/truncated to 35 tokens.

Reading checkpoints (key map, config from shapes, vocab) is ``reward_loading.py``; ``ImageReward.load`` calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelFileError

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


# --------------------------------------------------------------------------------------------------------------
# modules


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

    def preprocess(self, frames: torch.Tensor, mode: str = "torch") -> torch.Tensor:
        """[N,H,W,3] in [0,1] → [N,3,S,S] CLIP-normalized float32 on the model device (BICUBIC short side, crop).

        ``mode="torch"``: the float frames, antialiased torch bicubic (ours). ``mode="pil"``: the reference's path,
        uint8 frames (``x·255`` truncated, as torchvision's ``to_pil_image``) resized by PIL bicubic (compat.py).
        """
        size = self.config.image_size
        h, w = int(frames.shape[1]), int(frames.shape[2])
        nh, nw = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
        if mode == "pil":
            x = _pil_resize(frames, nh, nw).to(self.device)
        elif mode == "torch":
            x = frames.to(device=self.device, dtype=torch.float32).permute(0, 3, 1, 2)
            if (nh, nw) != tuple(x.shape[-2:]):
                x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
            x = x.clamp(0.0, 1.0)
        else:
            raise ConfigError(f"ImageReward preprocessing {mode!r} is not 'torch' or 'pil'.")
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
            return self.rewards(pixels, prompt.input_ids.expand(n, -1), prompt.attention_mask.expand(n, -1))

    def rewards(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Rewards ``[N]`` of preprocessed ``pixels [N,3,S,S]`` against token rows ``[N, 35]``, with autograd when
        enabled (what :meth:`score_pixels` runs; training a critic calls it directly)."""
        image = self.vision(pixel_values=pixels.to(self.dtype)).last_hidden_state
        hidden = self.text(
            input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image, is_decoder=False
        ).last_hidden_state
        r = self.mlp(hidden[:, 0, :].float())
        return ((r - REWARD_MEAN) / REWARD_STD).squeeze(-1)

    def score_chunks(
        self, frames: torch.Tensor, prompt: str | PreparedPrompt, chunk_size: int | None = None, *,
        preprocess: str = "torch",
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
                pixels = self.preprocess(frames[start : start + step], preprocess)
                chunk = self.score_pixels(pixels, prepared).to("cpu", torch.float32)
            yield chunk

    def score(
        self, frames: torch.Tensor, prompt: str | PreparedPrompt, *, chunk_size: int | None = None,
        preprocess: str = "torch",
    ) -> torch.Tensor:
        """ImageReward of each frame: ``[N]`` float32 on CPU. All frames go through one forward by default."""
        return torch.cat(list(self.score_chunks(frames, prompt, chunk_size, preprocess=preprocess)))


def _pil_resize(frames: torch.Tensor, nh: int, nw: int) -> torch.Tensor:
    """The reference's frames: uint8 (``x·255`` truncated after a clamp), PIL bicubic to ``nh × nw``; [N,3,nh,nw]
    float32 in [0, 1] on the CPU."""
    import numpy as np
    from PIL import Image

    u8 = frames.detach().float().clamp(0.0, 1.0).mul(255.0).to(torch.uint8).cpu().numpy()
    out = [np.asarray(Image.fromarray(f).resize((nw, nh), Image.BICUBIC)) for f in u8]
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).float().div_(255.0)
