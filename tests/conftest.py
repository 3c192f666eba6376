"""Shared fixtures. The tiny model tree is written once per session by the real `make-tiny` code path."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# One intra-op thread: the tiny models are far too small to gain from more, and on a shared 2-core
# machine two threads per op oversubscribe the cores (measured 10-30x slower under load).
torch.set_num_threads(1)

# The tiny preset that commands write when no model is named goes to a cache folder of this test process (each
# pytest-xdist worker has its own), never the user's: no two processes write the same preset at once.
os.environ["SDVG_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"sdvg-cache-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def bench_script(repo_root):
    """A loader of ``bench/<name>.py`` as a module (the scripts are not a package): ``bench_script("toy_heldout")``."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, repo_root / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny models tree, written once per session through the real `make-tiny` code path."""
    from sdvg.fixtures.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny-models")
    make_tiny(root)
    return root


@pytest.fixture(scope="session")
def tiny_models(tiny_dir):
    """All five tiny models loaded once per session on the CPU (fp32)."""
    from sdvg.loaders.bundle import load_models

    return load_models(tiny_dir, dit_device="cpu", aux_device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_vae_path(tmp_path_factory) -> Path:
    """The tiny Wan 2.1 VAE file alone (VAE and VAE-loading tests; cheaper than the whole tree)."""
    from sdvg.fixtures.tiny import write_tiny_vae

    return write_tiny_vae(tmp_path_factory.mktemp("tiny-vae"))


@pytest.fixture(scope="session")
def tiny_reward_path(tmp_path_factory) -> Path:
    """The tiny ImageReward checkpoint alone, with its vocab.txt and config.json beside it."""
    from sdvg.fixtures.tiny import write_tiny_image_reward

    return write_tiny_image_reward(tmp_path_factory.mktemp("tiny-reward"))


@pytest.fixture(scope="session")
def tiny_reward(tiny_reward_path):
    """The tiny ImageReward loaded once (fp32, CPU)."""
    from sdvg.loaders.reward import load_image_reward

    return load_image_reward(tiny_reward_path)
