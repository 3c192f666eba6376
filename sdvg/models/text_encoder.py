"""UMT5-XXL text encoder (encoder only, transformers ``UMT5EncoderModel``) with a strictly local tokenizer.

``encode(prompt)`` returns ``[1, 512, d_model]`` in the encoder dtype with the padding positions zeroed, like the
reference pipelines, and keeps the last few prompts in a small LRU cache. The files it comes from (Comfy-Org, Wan-AI
and Hugging Face layouts, the tokenizer beside them or inside) are read by ``loaders/text_encoder.py``.
"""

from __future__ import annotations

import html
import logging
import re
from collections import OrderedDict

import torch

from ..errors import ConfigError, ModelFileError

__all__ = ["TextEncoder", "LocalTokenizer", "clean_prompt"]

MAX_LENGTH = 512
logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# tokenizer


def clean_prompt(text: str) -> str:
    """The reference 'whitespace' cleaning: HTML unescape (twice) and collapse runs of whitespace."""
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class LocalTokenizer:
    """UMT5 tokenization from a local sentencepiece model (its bytes) or a ``tokenizer.json`` (its text): ids end with
    ``</s>`` and are truncated to ``max_length`` like the Hugging Face tokenizer with ``add_special_tokens``."""

    def __init__(self, *, spiece: bytes | None = None, tokenizer_json: str | None = None, source: str = "") -> None:
        self.source = source
        self._sp = None
        self._tk = None
        if spiece is not None:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor()
            try:
                self._sp.LoadFromSerializedProto(bytes(spiece))
            except (RuntimeError, OSError) as exc:
                raise ModelFileError(f"{source}: the sentencepiece tokenizer model is corrupt ({exc}).") from exc
            eos = self._sp.eos_id()
            self.eos_id = eos if eos >= 0 else 1
            self.vocab_size = self._sp.get_piece_size()
        elif tokenizer_json is not None:
            from tokenizers import Tokenizer

            try:
                self._tk = Tokenizer.from_str(tokenizer_json)
            except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type
                raise ModelFileError(f"{source}: not a readable tokenizer.json ({exc}).") from exc
            eos = self._tk.token_to_id("</s>")
            self.eos_id = 1 if eos is None else eos
            self.vocab_size = self._tk.get_vocab_size()
        else:
            raise ValueError("LocalTokenizer needs spiece bytes or a tokenizer.json text")

    def decode_tail(self, ids: list[int], words: int = 5) -> str:
        """The last few words of what ``ids`` say (where a truncated prompt stops)."""
        text = self._sp.decode(ids) if self._sp is not None else self._tk.decode(ids)
        return " ".join(text.split()[-words:])

    def ids(self, text: str, max_length: int = MAX_LENGTH) -> list[int]:
        text = clean_prompt(text)
        if self._sp is not None:
            ids = list(self._sp.encode(text, out_type=int)) + [self.eos_id]
        else:
            ids = list(self._tk.encode(text).ids)
            if not ids or ids[-1] != self.eos_id:
                ids.append(self.eos_id)
        if len(ids) > max_length:
            logger.warning("prompt truncated to %d tokens (it has %d; the text encoder reads at most %d): the words "
                           "after about %r are not seen", max_length, len(ids), max_length,
                           self.decode_tail(ids[: max_length - 1]))
            ids = ids[: max_length - 1] + [self.eos_id]
        return ids


# ----------------------------------------------------------------------------------------------------------
# the encoder


class TextEncoder:
    """UMT5 encoder + local tokenizer; ``encode(prompt) -> [1, 512, d_model]`` (padding zeroed, cached)."""

    def __init__(self, model, tokenizer: LocalTokenizer, *, name: str = "text encoder", cache_size: int = 8) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_length = MAX_LENGTH
        self.cache_size = max(0, int(cache_size))
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    @property
    def device(self) -> torch.device:
        return self.model.shared.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.shared.weight.dtype

    @property
    def text_dim(self) -> int:
        return int(self.model.config.d_model)

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (input_ids, attention_mask), both ``[1, 512]`` int64, padded with 0."""
        ids = self.tokenizer.ids(prompt, self.max_length)
        if max(ids) >= self.model.config.vocab_size:
            raise ModelFileError(
                f"{self.name}: the tokenizer ({self.tokenizer.source}) produced id {max(ids)} but the encoder has only "
                f"{self.model.config.vocab_size} embeddings; the tokenizer does not belong to these weights."
            )
        input_ids = torch.zeros(1, self.max_length, dtype=torch.long)
        mask = torch.zeros(1, self.max_length, dtype=torch.long)
        input_ids[0, : len(ids)] = torch.tensor(ids)
        mask[0, : len(ids)] = 1
        return input_ids, mask

    def encode(self, prompt: str) -> torch.Tensor:
        """``[1, 512, d_model]`` in the encoder dtype on its device; positions after the prompt's ``</s>`` are 0.
        The same prompt returns the same (cached) tensor object."""
        if not isinstance(prompt, str):
            raise ConfigError(f"The prompt must be text, got {type(prompt).__name__}.")
        hit = self._cache.get(prompt)
        if hit is not None:
            self._cache.move_to_end(prompt)
            return hit
        input_ids, mask = self.tokenize(prompt)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            out = (out * mask.unsqueeze(-1).to(out.dtype)).to(self.dtype)
        if self.cache_size:
            self._cache[prompt] = out
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out
