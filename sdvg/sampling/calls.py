"""Instrumentation hooks: the engine announces every model call, observers listen (as diffusers' hooks do).

Each DiT forward, cross-attention setup, VAE decode, VAE encode and ImageReward scoring is wrapped in
``with hooks.call(kind, signature):``. Observers (the run meter, the bench's tracer) get ``call_started`` before and
``call_finished`` after, with the same :class:`Call` object, so they can time it their own way (the bench waits for
the device first). Nothing replaces methods on model instances.

Calls may come from two threads at once (pipelined verification decodes and scores on a worker while the main
thread drafts): observers must be thread-safe, and can tell calls apart by identity.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

CALL_KINDS = ("target", "drafter", "setup", "decode", "encode", "score")


@dataclass(eq=False)
class Call:
    """One model call. ``signature`` is what its cost depends on besides the model: a DiT forward's
    (frame offset, frames, cache write), a decode's (first block of the video, latent frames), a score's (frames)."""

    kind: str
    signature: tuple = ()


class CallObserver(Protocol):
    def call_started(self, call: Call) -> None: ...

    def call_finished(self, call: Call) -> None: ...


class Hooks:
    """The observers of one run. Finished is announced in reverse order, also when the call raised."""

    def __init__(self, observers: Sequence[CallObserver] = ()) -> None:
        self.observers = tuple(observers)

    @contextmanager
    def call(self, kind: str, signature: tuple = ()) -> Iterator[Call]:
        call = Call(kind, signature)
        for obs in self.observers:
            obs.call_started(call)
        try:
            yield call
        finally:
            for obs in reversed(self.observers):
                obs.call_finished(call)


NO_HOOKS = Hooks()
