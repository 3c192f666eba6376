"""Training side of Diagonal Distillation: distil a few-step streaming student with DMD, diagonal forcing and flow
distribution matching (``python -m sdvg train diagonal``; see docs/TRAINING.md). Lazy (PEP 562): reading a config
imports no model code, so a bad config is reported before anything heavy loads."""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": "DiagonalTrainConfig load_config",
    "loop": "TrainResult train_diagonal",
})
