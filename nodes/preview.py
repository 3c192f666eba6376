"""Block previews for the canvas, converted off the sampling thread.

The sampler hands each finished block's frames to ``PreviewEncoder.submit`` (never blocks: when the small
queue is full the oldest pending block is dropped). A background thread turns frames into a small PIL
contact sheet. The sampling thread collects finished sheets with ``ready()`` and sends them through
``ProgressBar.update_absolute(value, total, ("JPEG", image, max_side))`` itself, because ComfyUI's progress
hook reads the executing node from a context variable of that thread and may raise its interrupt there.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch
from PIL import Image

logger = logging.getLogger(__name__)

_STOP = object()


def contact_sheet(frames: torch.Tensor, *, max_frames: int = 4, max_side: int = 512) -> Image.Image:
    """Up to ``max_frames`` evenly spaced frames of ``[N,H,W,3]`` (0..1) tiled 2x2 (or in a row), fit to ``max_side``."""
    n = int(frames.shape[0])
    if n == 0:
        raise ValueError("no frames to preview")
    count = min(max_frames, n)
    idx = [round(i * (n - 1) / max(1, count - 1)) for i in range(count)] if count > 1 else [n - 1]
    picked = frames[idx].detach().to("cpu", torch.float32).clamp(0, 1)
    arr = (picked * 255.0 + 0.5).to(torch.uint8).numpy()
    h, w = arr.shape[1], arr.shape[2]
    cols = 2 if count == 4 else count
    rows = (count + cols - 1) // cols
    sheet = Image.new("RGB", (cols * w, rows * h))
    for i, frame in enumerate(arr):
        sheet.paste(Image.fromarray(frame, "RGB"), ((i % cols) * w, (i // cols) * h))
    sheet.thumbnail((max_side, max_side))
    return sheet


class PreviewEncoder:
    """A daemon thread with a bounded input queue; ``submit`` drops rather than waits."""

    def __init__(self, *, max_side: int = 512, max_pending: int = 4, max_frames: int = 4):
        self.max_side = max_side
        self.max_frames = max_frames
        self.dropped = 0
        self._in: queue.Queue = queue.Queue(maxsize=max_pending)
        self._out: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sdvg-preview", daemon=True)
        self._thread.start()

    def submit(self, block: int, frames: torch.Tensor) -> None:
        n = int(frames.shape[0])
        count = min(self.max_frames, n)
        idx = [round(i * (n - 1) / max(1, count - 1)) for i in range(count)] if count > 1 else [n - 1]
        item = (block, frames[idx].detach().to("cpu").clone())  # own copy: the engine may reuse its buffer
        while True:
            try:
                self._in.put_nowait(item)
                return
            except queue.Full:
                try:
                    self._in.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def ready(self) -> list[tuple[int, Image.Image]]:
        out = []
        while True:
            try:
                out.append(self._out.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float = 10.0) -> list[tuple[int, Image.Image]]:
        """Finish the pending sheets (bounded wait) and return everything not yet collected."""
        try:
            self._in.put(_STOP, timeout=timeout)
        except queue.Full:
            logger.debug("preview queue still full at close")
        self._thread.join(timeout)
        return self.ready()

    def _run(self) -> None:
        while True:
            item = self._in.get()
            if item is _STOP:
                return
            block, frames = item
            try:
                self._out.put((block, contact_sheet(frames, max_frames=self.max_frames, max_side=self.max_side)))
            except Exception:
                logger.warning("preview for block %s failed", block, exc_info=True)
