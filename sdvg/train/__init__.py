"""Training side of Diagonal Distillation: distil a few-step streaming student with DMD, diagonal forcing and flow
distribution matching (``python -m sdvg train diagonal``; see docs/TRAINING.md)."""

from .config import DiagonalTrainConfig, load_config
from .loop import TrainResult, train_diagonal

__all__ = ["DiagonalTrainConfig", "TrainResult", "load_config", "train_diagonal"]
