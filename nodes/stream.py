"""The sampler node's canvas protocol: progress, block previews and the ``sdvg.*`` websocket events.

One :class:`BlockStream` per run: ``start`` (``sdvg.start``), ``step`` (progress, and previews that are ready),
``block`` (``sdvg.block`` with the routing decision, and the block's preview queued), ``done`` (``sdvg.done``),
``close`` (the preview thread stops; what it finished is sent). Previews go through ComfyUI's ProgressBar on the
node; each one is announced by an ``sdvg.preview`` event naming its block, so the web timeline can attach it.
"""

from __future__ import annotations

import math
import time
import uuid

from ..sdvg import json_float, to_jsonable
from ..sdvg.outputs import block_kind
from . import _host
from .preview import PreviewEncoder

PREVIEW_MAX_SIDE = 512
PROGRESS_PER_BLOCK = 100
EVENT_BLOCK = "sdvg.block"
EVENT_START = "sdvg.start"
EVENT_DONE = "sdvg.done"
EVENT_PREVIEW = "sdvg.preview"  # {node, display_node, block}: the next preview image of this node shows this block


def _frame_stats(scores: list) -> dict | None:
    values = [s for s in scores if isinstance(s, float) and math.isfinite(s)]
    if not values:
        return None
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values), "count": len(values)}


def block_payload(node_id: str, display_node_id: str, record, num_blocks: int, num_frames: int) -> dict:
    """The JSON body of one ``sdvg.block`` event (also what the web timeline renders).

    ``kind`` is the outcome the timeline colours: accept (draft kept) / reject (draft rejected, the target
    regenerated the block) / forced (the target made it without a draft: block 0, target-only), as in
    ``sdvg.report.block_kind``; ``drafted`` and ``produced_by`` are the record's own fields it is derived from.
    ``q`` and ``scores`` are the scores the router decided on (the draft's, for accept and reject);
    ``frame_stats`` is their min / mean / max."""
    data = record.to_dict()
    return {
        "node": node_id,
        "display_node": display_node_id,
        "block": int(data["block"]),
        "num_blocks": num_blocks,
        "kind": block_kind(data),
        "decision": data["decision"],
        "reason": data["reason"],
        "produced_by": data["produced_by"],
        "drafted": bool(data["drafted"]),
        "q": data["q"],
        "scores": data["scores"],
        "frame_stats": _frame_stats(record.scores),
        "tau": data["tau"],
        "aggregation": data["aggregation"],
        "steps": data["steps"],
        "frames": num_frames,
        "timings": {k: round(float(v), 4) for k, v in data["timings"].items()},
    }


class _Progress:
    """Monotonic per-node progress: each block is PROGRESS_PER_BLOCK units, split between drafter and target.

    ComfyUI's progress hook raises its interrupt once Cancel is pressed. With ``keep_on_cancel`` that interrupt is
    put back instead, so the sampler's own cancel poll stops the run after the current step and the finished blocks
    come out."""

    def __init__(self, num_blocks: int, node_id: str, keep_on_cancel: bool = False):
        self.total = num_blocks * PROGRESS_PER_BLOCK
        self.value = 0
        self.keep_on_cancel = keep_on_cancel
        self.bar = _host.progress_bar(self.total, node_id)

    def step(self, block: int, model: str, step: int, num_steps: int) -> None:
        half = PROGRESS_PER_BLOCK // 2
        start = block * PROGRESS_PER_BLOCK + (half if model == "target" else 0)
        self._set(start + int(half * (step + 1) / max(1, num_steps)) - 1)

    def block_done(self, block: int) -> None:
        self._set((block + 1) * PROGRESS_PER_BLOCK)

    def preview(self, image) -> None:
        self._set(self.value, image)

    def _set(self, value: int, preview=None) -> None:
        self.value = max(self.value, min(value, self.total))
        if self.bar is None:
            return
        # the host resizes to fit max_side, upwards too: a 64×64 preview must not be sent as a 512×512 one
        image = ("JPEG", preview, min(PREVIEW_MAX_SIDE, max(preview.size))) if preview is not None else None
        try:
            self.bar.update_absolute(self.value, self.total, image)
        except Exception as exc:
            if not (self.keep_on_cancel and _host.is_interrupt(exc)):
                raise
            _host.set_interrupt()


class BlockStream:
    """Streams one sampler run to the canvas (see the module docstring). Use as a context manager."""

    def __init__(self, node_id: str, display_id: str, num_blocks: int, *, keep_on_cancel: bool = False) -> None:
        self.ids = {"node": node_id, "display_node": display_id}
        self.num_blocks = num_blocks
        self.progress = _Progress(num_blocks, node_id, keep_on_cancel)
        self.encoder = PreviewEncoder(max_side=PREVIEW_MAX_SIDE)
        self.started = time.perf_counter()
        self._sent: set[int] = set()
        self.run_id = uuid.uuid4().hex[:12]
        self._summary: dict = {"run": self.run_id, "num_blocks": num_blocks, "blocks": []}

    def __enter__(self) -> BlockStream:
        return self

    def __exit__(self, *exc) -> None:
        self.encoder.close(timeout=1.0)  # a cancel or an error: stop the preview thread, bounded

    def start(self, width: int, height: int, router) -> None:
        self._summary.update(tau=json_float(router.tau), mode=router.mode)
        _host.send_event(EVENT_START, {**self.ids, "num_blocks": self.num_blocks, "width": width, "height": height,
                                       "tau": json_float(router.tau), "mode": router.mode, "run": self.run_id})

    def step(self, event) -> None:
        self._flush(self.encoder.ready())
        self.progress.step(event.block, event.model, event.step, event.num_steps)

    def block(self, event) -> None:
        self.encoder.submit(event.block, event.frames)
        self.progress.block_done(event.block)
        payload = block_payload(self.ids["node"], self.ids["display_node"], event.record, self.num_blocks,
                                int(event.frames.shape[0]))
        _host.send_event(EVENT_BLOCK, payload)
        self._summary["blocks"].append(payload)
        self._flush(self.encoder.ready())

    def done(self, report: dict) -> None:
        """Send the previews still pending, then ``sdvg.done``; notes the dropped previews in the report."""
        self._flush(self.encoder.close())
        report.setdefault("node", {})["preview_dropped"] = self.encoder.dropped
        done = {"totals": to_jsonable(report.get("totals")), "wall_s": round(time.perf_counter() - self.started, 3)}
        if report.get("fault"):  # a fault kept the finished blocks: the node shows the error
            done["fault"] = str(report["fault"])
        self._summary.update(done)
        _host.send_event(EVENT_DONE, {**self.ids, **done})

    def ui(self) -> dict:
        """The node's ``ui`` output: the whole timeline of this run. ComfyUI sends it again when the node is cached
        and keeps it in the history, so the web timeline can be rebuilt after a reload or a fully cached run."""
        return {"sdvg_timeline": [self._summary]}

    def _flush(self, items) -> None:
        for block, image in items:
            if block not in self._sent:
                self._sent.add(block)
                _host.send_event(EVENT_PREVIEW, {**self.ids, "block": block})
                self.progress.preview(image)
