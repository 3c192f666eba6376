"""Call hooks: observers hear every model call of a run, with its kind and signature, once each, from both threads
of pipelined verification, and a call that fails is still announced as finished."""

from __future__ import annotations

import threading

import pytest

from sdvg.sampling.calls import Call, Hooks
from sdvg.sampling.regimes import CacheConfig
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler


class Recorder:
    def __init__(self):
        self.open: dict[int, Call] = {}
        self.done: list[Call] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def call_started(self, call):
        with self.lock:
            self.open[id(call)] = call
            self.threads.add(threading.current_thread().name)

    def call_finished(self, call):
        with self.lock:
            assert self.open.pop(id(call)) is call
            self.done.append(call)


@pytest.mark.parametrize("pipelined", [False, True])
def test_observers_hear_every_call_of_a_run(tiny_models, pipelined):
    rec = Recorder()
    config = SamplerConfig(num_blocks=4, width=64, height=64, cache=CacheConfig("recompute"), pipelined=pipelined)
    router = RouterConfig(mode="pattern", pattern=(True, False, True), score_drafts=True)
    result = SpeculativeSampler(tiny_models, router, config).run("a fox", observers=[rec])
    assert not rec.open  # every start has its finish
    kinds = [c.kind for c in rec.done]
    forwards = {m: sum(r.forwards[m] for r in result.blocks) for m in ("target", "drafter")}
    assert kinds.count("target") == forwards["target"] and kinds.count("drafter") == forwards["drafter"]
    assert kinds.count("setup") == 2  # cross-attention K/V once per model and prompt
    assert kinds.count("decode") == 4 + 1 and kinds.count("score") == 3  # one rejected draft decoded twice
    # Krea's re-encoded first frame for blocks 2 and 3; pipelined, block 3 was also drafted on the speculative
    # history that assumed block 2 accepted (it was rejected): that encode is wasted, like the draft
    assert kinds.count("encode") == 2 + pipelined
    first_decode = next(c for c in rec.done if c.kind == "decode")
    assert first_decode.signature == (True, 3)
    assert {c.signature for c in rec.done if c.kind == "score"} == {(12,)}
    assert {c.signature[1:] for c in rec.done if c.kind in ("target", "drafter")} == {(3, True)}
    if pipelined:
        assert any(name.startswith("sdvg-verify") for name in rec.threads)  # decodes/scores on the worker


def test_a_failing_call_is_still_announced_as_finished():
    rec = Recorder()
    hooks = Hooks([rec])
    with pytest.raises(RuntimeError), hooks.call("decode", (True, 3)):
        raise RuntimeError("out of memory")
    assert [c.kind for c in rec.done] == ["decode"] and not rec.open
