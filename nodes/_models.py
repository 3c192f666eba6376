"""Our models as ComfyUI models: each loaded engine model is wrapped in the host's ``ModelPatcher``, so ComfyUI's
memory manager counts it, moves it and evicts it as it does its own.

* **Loading** (``load``, ``load_file``): ComfyUI is asked for room, the engine streams the file straight onto the chosen device, and
  the model is registered with ``load_models_gpu`` at once, so it is counted from the start.
* **Use** (``use``): before each run the node calls ``load_models_gpu`` for the models on each device, with what the
  run allocates beyond the weights there (KV caches, the VAE decoder cache; ``sdvg.run_memory``). ComfyUI evicts
  other models until that fits, and moves ours back if *Unload Models* or another node evicted them.
* **Lifetime**: one model per (kind, file, size, mtime, dtype, device) while anything holds it. The registry is
  weak: ComfyUI's own output cache keeps our handles, and with them the models, alive. *Unload Models*
  (``/free`` ``unload_models``) moves them to the offload device (CPU RAM); *Free model and node cache*
  (``free_memory``) also drops the output cache, and our models go with it. We never call ``unload_all_models``
  and never edit ComfyUI's list of loaded models.

What ComfyUI moves is a :class:`ManagedModule` view: the engine model's ``torch`` modules — all of them, or for a DiT
whose transformer blocks are streamed from pinned CPU memory (block offload) only what stays on the device; its
streaming slots are released when ComfyUI evicts it and come back with the next forward. Without a host (tests, bare
Python) there is no patcher and ``use`` does nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import _host

logger = logging.getLogger(__name__)


class ManagedModule(torch.nn.Module):
    """The modules of one engine model that ComfyUI moves between its load and offload devices."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device, name: str) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleDict(modules)
        self.device = device  # ModelPatcher reads and writes this attribute
        self.sdvg_name = name

    def extra_repr(self) -> str:
        return self.sdvg_name


@dataclass(eq=False)
class Managed:
    """One loaded engine model and the patcher ComfyUI manages it through (None without a host)."""

    kind: str
    name: str
    model: Any
    device: torch.device
    patcher: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes ComfyUI counts for it on its device."""
        if self.patcher is not None:
            return int(self.patcher.model_size())
        return _nbytes(_module_of(self.kind, self.model))

    def loaded_device(self) -> torch.device | None:
        """Where the weights are now (None when nothing manages them)."""
        return torch.device(self.patcher.current_loaded_device()) if self.patcher is not None else None


def _module_of(kind: str, model: Any) -> torch.nn.Module:
    """The ``torch`` module behind an engine model: the DiT and ImageReward are modules; the streaming VAE and the
    text encoder wrap one as ``.model``."""
    return model if isinstance(model, torch.nn.Module) else model.model


def _resident_parts(kind: str, model: Any) -> dict[str, torch.nn.Module]:
    """What ComfyUI moves: the whole module, or for a DiT whose blocks are streamed (block offload) everything but
    the streamed blocks, which stay in pinned CPU memory whatever ComfyUI does."""
    module = _module_of(kind, model)
    offloader = getattr(model, "block_offloader", None)
    if offloader is None:
        return {"model": module}
    parts = {f"child_{name}": child for name, child in module.named_children() if name != "blocks"}
    parts.update({f"block_{i}": module.blocks[i] for i in range(offloader.resident)})
    return parts


def _nbytes(*modules: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


_lock = threading.Lock()
_registry: weakref.WeakValueDictionary[tuple, Managed] = weakref.WeakValueDictionary()


def file_key(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns)


def load_file(kind: str, path: str, dtype: str, device: torch.device, loader: Callable[[], Any]) -> Managed:
    """The model in ``path`` for (kind, file, size, mtime, dtype, device); see :func:`load`."""
    return load(kind, (*file_key(path), dtype, str(device)), os.path.basename(path), os.path.getsize(path), device,
                loader)


def load(kind: str, key: tuple, name: str, nbytes: int, device: torch.device, loader: Callable[[], Any]) -> Managed:
    """The model for ``(kind, *key)``: the one already loaded while anything holds it, else ``loader()`` (after
    ComfyUI made room for about ``nbytes`` on ``device``), registered with ComfyUI's memory manager."""
    key = (kind, *key)
    with _lock:
        found = _registry.get(key)
    if found is not None:
        return found
    _host.free_memory_for(nbytes, device)
    model = loader()
    module = ManagedModule(_resident_parts(kind, model), device, f"{kind} {name}")
    offloader = getattr(model, "block_offloader", None)
    size = _nbytes(module) + (offloader.device_bytes() - _nbytes(*offloader.blocks[:offloader.resident])
                              if offloader is not None else 0)
    patcher = _host.model_patcher(module, device, _host.offload_device(kind, device), size=size)
    if offloader is not None and patcher is not None:  # evicted: the streaming slots leave the device too
        _host.on_detach(patcher, offloader.release_slots)
    managed = Managed(kind, name, model, device, patcher)
    use([managed])
    with _lock:
        _registry[key] = managed
    return managed


def use(managed: Iterable[Managed | None], needs: dict[torch.device, int] | None = None) -> None:
    """Make sure these models are on their devices before a run, through ComfyUI (one ``load_models_gpu`` call per
    device, with the bytes the run allocates there beyond the weights)."""
    by_device: dict[torch.device, list] = {}
    for m in managed:
        if m is not None and m.patcher is not None:
            by_device.setdefault(torch.device(m.patcher.load_device), []).append(m.patcher)
    for device, patchers in by_device.items():
        _host.load_models(list(dict.fromkeys(patchers)), (needs or {}).get(device, 0))


def park(managed: Managed | None) -> None:
    """Move one model to its offload device now (the loader's ``offload_to_cpu_when_idle``). ComfyUI's figures stay
    right: its entry reads the patcher, whose loaded size is then 0, and its next ``use`` moves the model back."""
    if managed is None or managed.patcher is None or managed.device.type == "cpu":
        return
    managed.patcher.detach(unpatch_all=True)
    _host.soft_empty_cache()


def loaded() -> list[Managed]:
    """The models this pack holds now (for the ``/sdvg/models`` route and the tests)."""
    with _lock:
        return list(_registry.values())


def size() -> int:
    return len(loaded())
