"""Shared fixtures. The tiny model tree is written once per session by the real `make-tiny` code path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
