"""``speedup_real``: a row's counted model calls priced at the real pair's per-call costs — a projection.

The toy world's wall-clock speedups come from tiny CPU models whose per-call ratios are not the real pair's (a toy
score costs about half a target block; ImageReward at real size about 1 % of one 14B forward). So every eval row also
counts its calls (an observer on the sampler's hooks, ``calls.py``) and prices them in multiply-accumulates of the
real models at 832×480 (SPEC §2 shapes, the paper-ratio profile's MAC model, ``sdvg/fixtures/paper_ratio.py`` and
docs/PERFORMANCE.md): ``speedup_real`` = the target-only row's priced calls / this row's, same prompt and seed.

Per call, in T MACs (10¹²), a block being 3 latent frames = 4,680 tokens attending to a 6-frame window:

* a Krea 14B forward of one block: 74 (15.8 G a token: 11.96 G weights + 3.8 G attention);
* a Self-Forcing 1.3B forward: 9.8 (2.1 G a token) — 7.5× cheaper by arithmetic (≈ 10× is the figure quoted for
  the pair; the MAC figure is used here, so the projection is the more conservative one);
* a Wan 2.1 VAE decode: 29 per block of 3 latent frames, priced per latent frame;
* ImageReward (ViT-L/16 at 224 + BERT): 0.75 per 12 frames, priced per frame;
* a VAE encode of one frame (the context re-encode): 1.3, an estimate (the encoder's convolutions at 96–384
  channels on one 832×480 frame, about half the decoder's per-frame cost);
* a forward over other than 3 latent frames is priced in proportion to its frames.

What it leaves out, so read it as MACs, not seconds: cross-attention setup (once per model and video, ≈ 1 T for
the 14B), memory traffic, transfers between GPUs, overlap of decode and score with drafting, and per-op overhead.
Measured GPU per-call costs, once a GPU run has them, replace the table (``RealCosts(...)``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..sampling.calls import Call


@dataclass(frozen=True)
class RealCosts:
    """T MACs per call of the real pair at 832×480 (module docstring: where each figure comes from)."""

    target_block: float = 74.0
    drafter_block: float = 9.8
    decode_latent_frame: float = 29.0 / 3
    score_frame: float = 0.75 / 12
    encode_frame: float = 1.3
    block_latent_frames: int = 3

    def price(self, call: Call) -> float:
        """T MACs of one counted call (0 for kinds the projection leaves out: setup)."""
        sig = call.signature
        if call.kind in ("target", "drafter"):
            per_block = self.target_block if call.kind == "target" else self.drafter_block
            frames = int(sig[1]) if len(sig) > 1 else self.block_latent_frames
            return per_block * frames / self.block_latent_frames
        if call.kind == "decode":
            return self.decode_latent_frame * (int(sig[1]) if len(sig) > 1 else self.block_latent_frames)
        if call.kind == "score":
            return self.score_frame * (int(sig[0]) if sig else 4 * self.block_latent_frames)
        if call.kind == "encode":
            return self.encode_frame
        return 0.0


REAL_COSTS = RealCosts()


class RealCostTally:
    """A call observer that adds up a run's calls at real-size prices (T MACs), per kind and in total."""

    def __init__(self, costs: RealCosts = REAL_COSTS) -> None:
        self.costs = costs
        self.by_kind: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()  # pipelined verification calls come from a worker thread

    def call_started(self, call: Call) -> None:
        del call

    def call_finished(self, call: Call) -> None:
        cost = self.costs.price(call)
        with self._lock:
            self.by_kind[call.kind] = self.by_kind.get(call.kind, 0.0) + cost
            self.counts[call.kind] = self.counts.get(call.kind, 0) + 1

    @property
    def total(self) -> float:
        return sum(self.by_kind.values())
