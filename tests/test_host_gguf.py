"""A GGUF MODEL from ComfyUI-GGUF's *Unet Loader (GGUF)* into *SDVG DiT from MODEL*, inside a real ComfyUI, opt-in:
needs a host (``SDVG_COMFYUI_DIR`` / ``SDVG_COMFYUI_PYTHON``, see tests/test_host_comfyui.py) and ComfyUI-GGUF at
``SDVG_COMFYUI_GGUF_DIR`` (default /work/hosts/ComfyUI-GGUF) with ``gguf`` installed in the host's Python; skipped,
with the reason, otherwise. The GGUF file (Q4_K blocks) run through ComfyUI-GGUF's loader must give the latents
SDVG's own loader gives on the same file, bit for bit (both keep the quantized bytes and dequantize per layer)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.host import comfy_server
from tests.test_host_comfyui import _latents, models_dir  # noqa: F401 - the module's models tree fixture

GGUF_NODES = Path(os.environ.get("SDVG_COMFYUI_GGUF_DIR", "/work/hosts/ComfyUI-GGUF"))
HOSTS = comfy_server.host_configs()


def _host_has_gguf(python: str) -> bool:
    return subprocess.run([python, "-c", "import gguf"], capture_output=True).returncode == 0


_REASON = (comfy_server.SKIP_REASON if not HOSTS else
           f"ComfyUI-GGUF is not installed at {GGUF_NODES} (set SDVG_COMFYUI_GGUF_DIR)" if not GGUF_NODES.is_dir()
           else "")
pytestmark = [pytest.mark.host, pytest.mark.skipif(bool(_REASON), reason=_REASON or "-")]


@pytest.fixture(scope="module", params=HOSTS or [None], ids=[label for label, _t, _p in HOSTS] or ["none"])
def gguf_server(request, models_dir):  # noqa: F811
    from safetensors.torch import load_file

    from sdvg.fixtures.quant_files import write_gguf_dit

    _label, tree, python = request.param
    if not _host_has_gguf(python):
        pytest.skip(f"the host's Python {python} has no gguf package (ComfyUI-GGUF needs it)")
    state = load_file(str(models_dir / "diffusion_models" / "sdvg_core_wan.safetensors"))
    write_gguf_dit(models_dir / "diffusion_models" / "sdvg_core_wan-Q4_K.gguf", state, qtype="Q4_K", seed=5)
    srv = comfy_server.ComfyServer(models_dir, host=(tree, python), extra_nodes=(GGUF_NODES,)).start()
    yield srv
    srv.stop()


def test_a_gguf_model_from_comfyui_gguf_runs_as_our_target_bit_for_bit(gguf_server):
    ours = {"30": {"class_type": "SDVGModelLoader", "inputs": {"model_name": "sdvg_core_wan-Q4_K.gguf",
                                                               "weight_dtype": "fp32", "device": "cpu",
                                                               "offload": "keep_loaded"}}}
    core = {"30": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": "sdvg_core_wan-Q4_K.gguf"}},
            "31": {"class_type": "SDVGDiTFromModel", "inputs": {"model": ["30", 0], "weight_dtype": "fp32",
                                                                "device": "cpu", "offload": "keep_loaded"}}}
    latents = {name: _latents(gguf_server, target, f"sdvg_gguf_{name}") for name, target in (("file", ours),
                                                                                             ("core", core))}
    assert latents["file"].abs().sum() > 0
    assert torch.equal(latents["file"], latents["core"])
