"""The few ComfyUI host services the nodes use, each behind one small function.

Every access is guarded so the node code also runs under the test stub and in a bare Python (a missing host
service degrades to a no-op, never to a crash). This module is the only place that knows where in ComfyUI a
service lives.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

IMAGE_REWARD_FOLDER = "image_reward"


# --------------------------------------------------------------------------------------------- devices
def device_options() -> list[str]:
    """``auto``, ``cpu`` and one ``cuda:N`` per CUDA device that exists now (built at schema time)."""
    options = ["auto", "cpu"]
    try:
        if torch.cuda.is_available():
            options += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install must not break the node list
        logger.debug("CUDA device query failed", exc_info=True)
    return options


def model_management():
    try:
        import comfy.model_management as mm
    except ImportError:
        return None
    return mm


def intermediate_device() -> torch.device:
    mm = model_management()
    if mm is not None and hasattr(mm, "intermediate_device"):
        return mm.intermediate_device()
    return torch.device("cpu")


def free_memory_for(num_bytes: int, device: torch.device) -> None:
    """Ask ComfyUI to make room for a load of ``num_bytes`` on ``device`` (CUDA only; never unloads everything)."""
    mm = model_management()
    if mm is None or device.type != "cuda" or not hasattr(mm, "free_memory"):
        return
    try:
        mm.free_memory(int(num_bytes * 1.2), device)
    except Exception:
        logger.debug("free_memory failed", exc_info=True)


OFFLOAD_DEVICE_GETTERS = {"dit": "unet_offload_device", "reward": "unet_offload_device", "vae": "vae_offload_device",
                          "text_encoder": "text_encoder_offload_device"}


def offload_device(kind: str, load_device: torch.device) -> torch.device:
    """Where ComfyUI parks a model of this kind when it evicts it (CPU RAM unless the host is told otherwise)."""
    mm = model_management()
    getter = getattr(mm, OFFLOAD_DEVICE_GETTERS.get(kind, "unet_offload_device"), None) if mm is not None else None
    if load_device.type == "cpu" or getter is None:
        return torch.device("cpu")
    return torch.device(getter())


def model_patcher(module: torch.nn.Module, load_device: torch.device, offload: torch.device, size: int = 0):
    """ComfyUI's ModelPatcher around ``module`` (None without a host: tests and bare Python manage nothing);
    ``size``: the bytes it occupies on ``load_device`` (0: ComfyUI measures the module)."""
    try:
        from comfy.model_patcher import ModelPatcher
    except ImportError:
        return None
    return ModelPatcher(module, load_device=load_device, offload_device=offload, size=int(size))


def on_detach(patcher, fn) -> None:
    """Call ``fn()`` whenever ComfyUI evicts this patcher's model (its ON_DETACH callback)."""
    try:
        from comfy.patcher_extension import CallbacksMP
    except ImportError:
        return
    patcher.add_callback(CallbacksMP.ON_DETACH, lambda _patcher, _unpatch_all: fn())


def load_models(patchers: list, memory_required: int) -> None:
    """ComfyUI's ``load_models_gpu`` for models on one device: it evicts other models until ``memory_required``
    bytes (what the run allocates beyond the weights) fit beside them, then moves ours onto the device (fully:
    our modules cannot run from partially loaded weights)."""
    mm = model_management()
    if mm is None or not patchers or not hasattr(mm, "load_models_gpu"):
        return
    mm.load_models_gpu(patchers, memory_required=int(memory_required), force_full_load=True)


def is_loaded_by_host(patcher) -> bool:
    """Whether ComfyUI's memory manager lists this patcher among its loaded models (read only)."""
    mm = model_management()
    loaded = getattr(mm, "current_loaded_models", None) if mm is not None and patcher is not None else None
    return bool(loaded) and any(getattr(entry, "model", None) is patcher for entry in loaded)


def process_rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def soft_empty_cache() -> None:
    mm = model_management()
    if mm is not None and hasattr(mm, "soft_empty_cache"):
        mm.soft_empty_cache()


def processing_interrupted() -> bool:
    mm = model_management()
    return bool(mm is not None and mm.processing_interrupted())


def raise_if_interrupted() -> None:
    """Raise ComfyUI's own interrupt exception when the user pressed Cancel (clears the flag)."""
    mm = model_management()
    if mm is not None:
        mm.throw_exception_if_processing_interrupted()


def is_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is ComfyUI's interrupt (raised by its progress hook once the user pressed Cancel)."""
    mm = model_management()
    cls = getattr(mm, "InterruptProcessingException", None) if mm is not None else None
    return cls is not None and isinstance(exc, cls)


def set_interrupt() -> None:
    """Put a consumed Cancel back, so the next cancel poll sees it."""
    mm = model_management()
    if mm is not None and hasattr(mm, "interrupt_current_processing"):
        mm.interrupt_current_processing(True)


def clear_interrupt() -> None:
    """Consume the user's Cancel without raising (the node returns what it finished instead)."""
    mm = model_management()
    if mm is not None and hasattr(mm, "interrupt_current_processing"):
        mm.interrupt_current_processing(False)


# --------------------------------------------------------------------------------------------- core MODEL
CORE_PREFIX = "diffusion_model."


class CoreWeights(NamedTuple):
    """What SDVG needs from a core MODEL's Wan DiT."""

    shapes: dict[str, tuple[int, ...]]  # original key → shape
    read: Callable[[str], torch.Tensor]  # one weight, the MODEL's weight patches applied
    heads: int | None
    stored_dtype: torch.dtype
    identity: tuple  # the MODEL and its patches, for caching
    quantized_bytes: int | None = None  # GGUF (ComfyUI-GGUF) or scaled-fp8 MODEL: its weights' bytes as stored


def core_wan_weights(model) -> CoreWeights:
    """:class:`CoreWeights` of a core ``MODEL`` holding a Wan 2.1 T2V DiT; ``read`` applies the MODEL's weight
    patches (LoRAs, merges) with ComfyUI's own ``comfy.lora.calculate_weight``. Anything else is a ConfigError naming
    what it is."""
    from ..sdvg import ConfigError

    base = getattr(model, "model", None)
    dm = getattr(base, "diffusion_model", None)
    kind = type(dm).__name__ if dm is not None else type(model).__name__
    if kind != "WanModel" or getattr(dm, "model_type", "t2v") != "t2v" or getattr(dm, "img_emb", None) is not None:
        raise ConfigError(
            f"SDVG DiT from MODEL needs a Wan 2.1 text-to-video DiT (core WanModel, t2v); this MODEL holds {kind}"
            f"{' (' + str(getattr(dm, 'model_type', '')) + ')' if dm is not None else ''}. Load a Wan 2.1 T2V "
            "checkpoint with Load Diffusion Model, or use SDVG Load Video DiT."
        )
    from ..sdvg.loaders import core_nbytes, core_weight, split_scales
    from ..sdvg.models import is_stored_quant

    # a ComfyUI-GGUF MODEL holds GGMLTensor weights (kept quantized: QuantTensor), a scaled-fp8 MODEL fp8 weights
    # with scale_weight / weight_scale entries (kept as fp8 + scale)
    weights, scales = split_scales(_core_state(model, dm))
    patches = dict(getattr(model, "patches", {}) or {})
    if getattr(model, "hook_patches", None):
        logger.warning("SDVG DiT from MODEL: the MODEL's hook patches (scheduled LoRAs) are not applied")

    def read(key: str):
        weight, full = core_weight(weights[key], scales.get(key)), CORE_PREFIX + key
        if full not in patches:
            return weight
        from comfy.lora import calculate_weight

        # in fp32, as ComfyUI computes it; SDVG's loader then rounds once, to the weight dtype chosen here (a
        # quantized weight a LoRA patches is dequantized first and stays dense)
        dense = weight.dequantize(torch.float32) if is_stored_quant(weight) else weight.to(torch.float32, copy=True)
        return calculate_weight(patches[full], dense, full)

    quantized = bool(scales) or any(getattr(v, "tensor_type", None) is not None for v in weights.values())
    dtypes = [v.dtype for v in weights.values() if v.is_floating_point() and getattr(v, "tensor_type", None) is None]
    stored = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    identity = (id(base), str(getattr(model, "patches_uuid", "")))
    shapes = {k: tuple(int(d) for d in v.shape) for k, v in weights.items()}
    nbytes = sum(core_nbytes(v) for v in (*weights.values(), *scales.values())) if quantized else None
    return CoreWeights(shapes, read, int(getattr(dm, "num_heads", 0)) or None, stored, identity, nbytes)


def _core_state(model, dm) -> dict:
    """The DiT's weights by key. ComfyUI-GGUF's state dict is a stand-in for its memory estimate (meta tensors and a
    ``temp.weight`` entry), so a GGUF MODEL's weights are read from its layers (GGMLTensor parameters) instead."""
    params = dict(dm.named_parameters())
    if any(getattr(v, "tensor_type", None) is not None for v in params.values()):
        return params
    return {k[len(CORE_PREFIX):]: v for k, v in model.model_state_dict(CORE_PREFIX).items()}


# --------------------------------------------------------------------------------------------- folders
def folder_paths():
    try:
        import folder_paths as fp
    except ImportError:
        return None
    return fp


def ensure_image_reward_folder() -> None:
    """Register ``models/image_reward`` once; a folder already declared (extra_model_paths.yaml) is kept as is."""
    fp = folder_paths()
    if fp is None:
        return
    if IMAGE_REWARD_FOLDER not in fp.folder_names_and_paths:
        fp.add_model_folder_path(IMAGE_REWARD_FOLDER, os.path.join(fp.models_dir, IMAGE_REWARD_FOLDER))


def register_toy_models() -> None:
    """Add the pack's committed toy-world models (``sdvg/toy/models/<folder>``) to ComfyUI's model folders, after the
    user's own (``add_model_folder_path``, not the default path): the toy CPU workflow runs with no download."""
    fp = folder_paths()
    if fp is None:
        return
    from ..sdvg.toy import TOY_DIR

    ensure_image_reward_folder()
    for folder in ("diffusion_models", "text_encoders", "vae", IMAGE_REWARD_FOLDER):
        path = TOY_DIR / folder
        if path.is_dir():
            fp.add_model_folder_path(folder, str(path))


WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".ckpt", ".sft", ".bin")


def list_model_files(folder: str, *, gguf: bool = False) -> list[str]:
    """Weight files in a model folder (never tokenizer or vocab files that may sit beside them); ``gguf``: also the
    ``.gguf`` files there, which ComfyUI's own list leaves out (its folders know no ``.gguf`` extension)."""
    fp = folder_paths()
    if fp is None:
        return []
    try:
        names = fp.get_filename_list(folder)
    except KeyError:
        return []
    names = [n for n in names if n.lower().endswith(WEIGHT_SUFFIXES)]
    return sorted(set(names) | set(_gguf_files(fp, folder))) if gguf else names


def _gguf_files(fp, folder: str) -> list[str]:
    out = []
    for base in fp.get_folder_paths(folder):
        for root, _, files in os.walk(base, followlinks=True):
            out += [os.path.relpath(os.path.join(root, f), base).replace(os.sep, "/") for f in files
                    if f.lower().endswith(".gguf")]
    return out


def full_model_path(folder: str, name: str) -> str:
    from ..sdvg import ModelFileError

    fp = folder_paths()
    path = None if fp is None else fp.get_full_path(folder, name)
    if not path:
        where = ", ".join(fp.get_folder_paths(folder)) if fp is not None and folder in fp.folder_names_and_paths else "?"
        raise ModelFileError(
            f"Model file '{name}' was not found in the '{folder}' folder ({where}). "
            f"Put it there (or map '{folder}' in extra_model_paths.yaml) and press R to refresh the node lists."
        )
    return path


# --------------------------------------------------------------------------------------------- server
def prompt_server():
    try:
        from server import PromptServer
    except ImportError:
        return None
    return getattr(PromptServer, "instance", None)


def send_event(event: str, data: dict) -> None:
    """Custom websocket event to the client that queued the running prompt (thread-safe in ComfyUI)."""
    server = prompt_server()
    if server is None:
        return
    server.send_sync(event, data, getattr(server, "client_id", None))


def progress_bar(total: int, node_id: str | None):
    try:
        import comfy.utils
    except ImportError:
        return None
    return comfy.utils.ProgressBar(total, node_id=node_id)
