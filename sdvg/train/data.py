"""Where a DMD run's prompts come from. Text-only DMD needs no videos: the teacher supplies the scores.

- ``toy``: the toy world's captions (drawn per step from the step's generator), encoded once by the toy text encoder;
- a ``.txt`` file or a folder of them (one prompt per line): encoded once by the given text encoder, then cached as
  ``<out>/text_embeds.pt`` (bf16) so a resumed or repeated run loads no encoder;
- a ``.pt`` text-embedding cache (``{"prompts": [...], "embeds": [N, L, D]}``, loaded with ``weights_only``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import ConfigError
from ..loaders.checkpoint import torch_load

logger = logging.getLogger(__name__)


class PromptBank:
    """Text embeddings of every training prompt (the encoder is frozen and dropped after encoding)."""

    def __init__(self, prompts: list[str], embeds: torch.Tensor, negative: torch.Tensor) -> None:
        if not prompts:
            raise ConfigError("The training data holds no prompts.")
        self.prompts = prompts
        self.embeds = embeds
        self.negative = negative

    def draw(self, gen: torch.Generator, n: int) -> torch.Tensor:
        """Indices of ``n`` prompts for one step (the global batch; every rank draws the same)."""
        return torch.randint(len(self.prompts), (n,), generator=gen)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embeds[idx].float()

    def save(self, path: Path) -> None:
        torch.save({"prompts": self.prompts, "embeds": self.embeds, "negative": self.negative}, str(path))


def _encode(prompts: list[str], text_encoder: str | None) -> PromptBank:
    from ..loaders.text_encoder import load_text_encoder

    if text_encoder is None:
        raise ConfigError("Encoding prompts needs a text encoder: --text-encoder FILE.")
    te = load_text_encoder(text_encoder, device="cpu", dtype="fp32")
    with torch.no_grad():
        embeds = torch.cat([te.encode(p).float().cpu() for p in prompts])
        negative = te.encode("").float().cpu()
    return PromptBank(prompts, embeds, negative)


def _read_prompts(path: Path) -> list[str]:
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"{path} holds no .txt prompt files.")
    prompts = [ln.strip() for f in files for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not prompts:
        raise ConfigError(f"{path}: no prompts (one per line).")
    return prompts


def load_prompts(data: str, text_encoder: str | None, out: Path) -> PromptBank:
    if data == "toy":
        from ..toy.preset import toy_files
        from ..toy.world import train_captions

        return _encode(train_captions(), text_encoder or str(toy_files()["text_encoder"]))
    path = Path(data)
    if not path.exists():
        raise ConfigError(f"Training data {path} does not exist; give 'toy', a prompt .txt file or folder, or a .pt "
                          "text-embedding cache.")
    if path.suffix == ".pt":
        st = torch_load(path)
        if not isinstance(st, dict) or not {"prompts", "embeds"} <= set(st):
            raise ConfigError(f"{path} is not a text-embedding cache (keys prompts, embeds).")
        neg = st.get("negative", torch.zeros_like(st["embeds"][:1]))
        return PromptBank(list(st["prompts"]), st["embeds"], neg)
    cache = out / "text_embeds.pt"
    prompts = _read_prompts(path)
    if cache.is_file():
        st = torch_load(cache)
        if list(st["prompts"]) == prompts:
            return PromptBank(prompts, st["embeds"], st["negative"])
    bank = _encode(prompts, text_encoder)
    bank.embeds = bank.embeds.to(torch.bfloat16)
    bank.negative = bank.negative.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    bank.save(cache)
    logger.info("encoded %d prompts into %s", len(prompts), cache)
    return bank
