"""Transformer-block offload: K blocks stay on the compute device, the others are streamed in from (pinned) CPU memory.

:class:`BlockOffloader` is the DiT's block-iteration strategy (``CausalWanTransformer.iter_blocks`` goes through it
when one is set). The streamed blocks' parameters live in CPU storage (pinned on CUDA); two device slots of one
block's size take turns: while block ``i`` computes in one slot, block ``i+1`` is copied into the other on a side
CUDA stream, and the compute stream waits for that copy (an event) before it uses the block. A slot is refilled only
after the compute stream has finished with the block it held (another event). Without CUDA the copies are plain
synchronous ``copy_`` calls through the same code path, which is how the CPU tests force it.

The weights computed with are bit-for-bit the stored ones (a copy, no conversion), so the output is bit-identical
with and without offloading. The device holds the non-block weights, the K resident blocks and the two slots.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from ..devices import FP8_STORAGE
from ..errors import ConfigError
from ..memory import GB, HEADROOM, check_fits, free_bytes

logger = logging.getLogger(__name__)

SLOTS = 2  # device buffers for streamed blocks: one computing, one being filled
# what "auto" leaves free beside the DiT's own share: the other models, the KV and cross-attention caches, the VAE
# decoder cache and the activations (the 832x480 recompute plan for 14B + 1.3B needs about this much; see
# `python -m sdvg bench --profile real-size --dry-run`)
DEFAULT_RESERVE_BYTES = 14 * 2**30


def module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def parse_offload(value) -> int | str | None:
    """``None``/``"none"``/``"off"`` → no offload; ``"auto"``; a whole number of resident blocks ≥ 0."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"Block offload {value!r}: use a number of resident blocks (0 or more), 'auto' or "
                              "'none'.") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"Block offload {value!r}: the number of resident blocks must be a whole number ≥ 0.")
    return value


def resident_blocks(spec, *, num_blocks: int, block_bytes: int, other_bytes: int, device: torch.device,
                    reserve_bytes: int = DEFAULT_RESERVE_BYTES, free: int | None = None) -> int | None:
    """How many blocks stay resident for an offload setting: ``None`` (no offloader), a fixed K (capped at the
    block count), or for ``"auto"`` as many as fit in the free memory of ``device`` after the non-block weights,
    the two slots and ``reserve_bytes`` (``free`` overrides the measured free memory)."""
    spec = parse_offload(spec)
    if spec is None:
        return None
    if spec != "auto":
        return min(spec, num_blocks)
    free = free_bytes(device) if free is None else free
    if free is None:
        raise ConfigError(f"offload 'auto': the free memory of {device} is unknown here; give a number of resident "
                          "blocks instead.")
    room = free * HEADROOM - reserve_bytes - other_bytes - SLOTS * block_bytes
    k = max(0, min(num_blocks, math.floor(room / block_bytes)))
    logger.info("offload auto on %s: %.1f GB free, %.1f GB reserved, %.2f GB per block -> %d of %d blocks resident",
                device, free / GB, reserve_bytes / GB, block_bytes / GB, k, num_blocks)
    return k


def dit_offload_plan(config: dict, num_params: int, element_size: int, spec, device: torch.device,
                     reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> tuple[int | None, int, int]:
    """For a DiT with ``config`` stored at ``element_size`` bytes per parameter: (resident blocks or None, bytes on
    ``device``, bytes per block)."""
    from .dit import dit_param_shapes

    shapes = dit_param_shapes(config)
    block = int(element_size * sum(math.prod(v) for k, v in shapes.items() if k.startswith("blocks.0.")))
    layers = int(config["num_layers"])
    other = int(num_params * element_size) - layers * block
    k = resident_blocks(spec, num_blocks=layers, block_bytes=block, other_bytes=other, device=device,
                        reserve_bytes=reserve_bytes)
    need = int(num_params * element_size) if k is None else other + (k + (SLOTS if k < layers else 0)) * block
    return k, need, block


# bytes per parameter of the GGUF types the advice names (block bytes / block values)
GGUF_SIZES = (("Q8_0", 34 / 32), ("Q4_K", 144 / 256))


def fit_advice(info, bytes_per_param: float, block: int, device: torch.device) -> str:
    """What would make a DiT that does not fit smaller on ``device``: fp8 storage, a GGUF file, block offload (a GPU
    only: on the CPU the streamed blocks stay in the same RAM), each with the size it gives."""
    n, layers, parts = info.num_params, info.config["num_layers"], []
    if bytes_per_param > 1 and not getattr(info, "quantized", False):
        parts.append(f"As {FP8_STORAGE} weights it needs about {n / GB:.1f} GB (--target-dtype / --drafter-dtype "
                     f"{FP8_STORAGE}, --dtype for both, or the loader's weight_dtype).")
    ggufs = [f"{n * b / GB:.1f} GB as {name}" for name, b in GGUF_SIZES if b < bytes_per_param * 0.95]
    if ggufs:
        parts.append(f"A GGUF file of this model stays quantized on the device: about {' or '.join(ggufs)} "
                     "(Q4_K_M files a little more).")
    if device.type != "cpu":
        parts.append(f"Block offload (--target-offload-blocks K, or auto) keeps only K of its {layers} blocks "
                     f"({block / GB:.2f} GB each) on {device} and streams the rest from pinned CPU RAM.")
    return " ".join(parts)


def check_dit_fits(path, info, dtype: torch.dtype, fp8: bool, device: torch.device,
                offload=None, reserve: int = DEFAULT_RESERVE_BYTES) -> int | None:
    """Refuse a DiT load (``info``: its ``DiTCheckpointInfo``) that cannot fit, before reading; → the resident block
    count when offloading (None: none). A GGUF / scaled-fp8 file counts its stored bytes (``info.device_bytes``)."""
    quantized = getattr(info, "quantized", False)
    size = (info.device_bytes(dtype) / max(info.num_params, 1) if quantized else
            1 if fp8 else torch.empty((), dtype=dtype).element_size())
    k, need, block = dit_offload_plan(info.config, info.num_params, size, offload, device, reserve)
    layers = info.config["num_layers"]
    kind = ", ".join(sorted(info.quant)) if quantized else FP8_STORAGE if fp8 else str(dtype).replace("torch.", "")
    label = kind + ("" if k is None else f", {k} of {layers} blocks resident")
    check_fits(f"{path} ({info.size_label}, {info.num_params / 1e9:.2f} B parameters as {label})", need, device,
               options=fit_advice(info, size, block, device))
    if k is not None and k < layers and device.type != "cpu":
        # an offloaded DiT is built in CPU RAM first (then K blocks move to the device, the rest get pinned)
        check_fits(f"{path} built in CPU RAM for block offload ({layers - k} blocks stay there, pinned)",
                   int(info.num_params * size), torch.device("cpu"))
    return k


def _move_non_blocks(model, device: torch.device) -> None:
    for name, child in model.named_children():
        if name != "blocks":
            child.to(device)
    for p in model.parameters(recurse=False):
        p.data = p.data.to(device)


def offload_model(model, device: torch.device, resident: int) -> BlockOffloader:
    """Move everything but ``model.blocks`` to ``device`` and stream the blocks through a new offloader."""
    _move_non_blocks(model, device)
    offloader = BlockOffloader(model.blocks, device, resident)
    model.set_block_offloader(offloader)
    return offloader


def move_model(model, device: str | torch.device) -> None:
    """``model.to(device)`` that keeps block offload intact: with an offloader the non-block weights and the resident
    blocks move and the streamed blocks stay in their CPU storage (a host's model manager moves an offloaded DiT
    with this, never with ``.to``, which would copy every streamed block onto the device)."""
    device = torch.device(device)
    offloader = getattr(model, "block_offloader", None)
    if offloader is None:
        model.to(device)
        return
    _move_non_blocks(model, device)
    offloader.place(device)


class BlockOffloader:
    """Keeps ``blocks[:resident]`` on ``device`` and streams the rest from CPU storage (see the module docstring).

    ``pin_memory`` defaults to True on CUDA (asynchronous copies need page-locked memory) and False elsewhere."""

    def __init__(self, blocks: nn.ModuleList, device: str | torch.device, resident: int, *,
                 pin_memory: bool | None = None) -> None:
        self.device = torch.device(device)
        self.blocks = blocks
        self.resident = max(0, min(int(resident), len(blocks)))
        self._cuda = self.device.type == "cuda"
        pin = self._cuda if pin_memory is None else pin_memory
        if any(True for b in blocks for _ in b.buffers()):
            raise ConfigError("Block offload streams parameters only; these blocks hold buffers.")
        self._params: list[list[nn.Parameter]] = []
        self._names: list[list[str]] = []
        self._storage: list[list[torch.Tensor]] = []
        for i, blk in enumerate(blocks):
            named = list(blk.named_parameters())
            params = [p for _, p in named]
            self._params.append(params)
            self._names.append([n for n, _ in named])
            if i < self.resident:
                blk.to(self.device)
                self._storage.append([])
                continue
            store = []
            for p in params:
                t = p.data if p.device.type == "cpu" else p.data.to("cpu")
                t = t.pin_memory() if pin else t
                p.data = t
                store.append(t)
            self._storage.append(store)
        # one byte buffer per parameter name, as large as that parameter is in any streamed block: blocks may differ
        # in layout (a GGUF Q4_K_M file stores some blocks' layers as Q6_K)
        self._slot_bytes: dict[str, int] = {}
        for names, store in zip(self._names[self.resident:], self._storage[self.resident:], strict=True):
            for name, t in zip(names, store, strict=True):
                self._slot_bytes[name] = max(self._slot_bytes.get(name, 0), t.numel() * t.element_size())
        self._slots: list[dict[str, torch.Tensor]] | None = None
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._ready: dict[int, torch.cuda.Event] = {}  # block → its copy has landed
        self._slot_free: list[torch.cuda.Event | None] = [None] * SLOTS  # slot → its last block has been used

    def place(self, device: str | torch.device) -> None:
        """Move the resident blocks to ``device`` and stream into slots there from now on (storage stays put)."""
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        for i in range(self.resident):
            self.blocks[i].to(self.device)
        self._slots = None
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._ready.clear()
        self._slot_free = [None] * SLOTS

    @property
    def streamed(self) -> int:
        return len(self.blocks) - self.resident

    @property
    def block_bytes(self) -> int:
        """Bytes of one device slot (the largest streamed block's layout, per parameter)."""
        return sum(self._slot_bytes.values()) if self.streamed else 0

    def device_bytes(self) -> int:
        """Bytes of blocks this offloader keeps on the device: resident blocks plus the slots."""
        resident = sum(module_bytes(self.blocks[i]) for i in range(self.resident))
        return resident + (SLOTS * self.block_bytes if self.streamed else 0)

    def release_slots(self) -> None:
        """Free the device slots the streamed blocks pass through (between forwards; a host evicting the model calls
        it). The next forward allocates them again."""
        if self._stream is not None:
            self._stream.synchronize()
        self._slots = None
        self._ready.clear()
        self._slot_free = [None] * SLOTS

    def _slot(self, i: int) -> list[torch.Tensor]:
        """Block ``i``'s parameters as views into its device slot (each its own dtype and shape)."""
        if self._slots is None:
            self._slots = [{name: torch.empty(n, dtype=torch.uint8, device=self.device)
                            for name, n in self._slot_bytes.items()} for _ in range(SLOTS)]
        slot = self._slots[(i - self.resident) % SLOTS]
        return [slot[name][: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for name, t in zip(self._names[i], self._storage[i], strict=True)]

    def _fetch(self, i: int) -> None:
        """Start copying block ``i`` into its slot (side stream on CUDA, after the slot's last user finished)."""
        slot, n = self._slot(i), (i - self.resident) % SLOTS
        if self._stream is None:
            for dst, src in zip(slot, self._storage[i], strict=True):
                dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            if self._slot_free[n] is not None:
                self._stream.wait_event(self._slot_free[n])
            for dst, src in zip(slot, self._storage[i], strict=True):
                dst.copy_(src, non_blocking=True)
            self._ready[i] = self._stream.record_event()

    def _bind(self, i: int) -> None:
        ready = self._ready.pop(i, None)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        for p, t in zip(self._params[i], self._slot(i), strict=True):
            p.data = t

    def _release(self, i: int) -> None:
        if self._cuda:
            self._slot_free[(i - self.resident) % SLOTS] = torch.cuda.current_stream(self.device).record_event()
        for p, t in zip(self._params[i], self._storage[i], strict=True):
            p.data = t

    def __iter__(self) -> Iterator[tuple[int, nn.Module]]:
        """``(i, block)`` in order, each block's weights on the device while the caller runs it."""
        n = len(self.blocks)
        if self.resident < n:
            self._fetch(self.resident)  # overlaps the resident blocks' compute
        bound = None
        try:
            for i, blk in enumerate(self.blocks):
                if i >= self.resident:
                    self._bind(i)
                    bound = i
                    if i + 1 < n:
                        self._fetch(i + 1)
                yield i, blk
                if bound is not None:
                    self._release(bound)
                    bound = None
        finally:
            if bound is not None:
                self._release(bound)
            self._ready.clear()
