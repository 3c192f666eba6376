"""The Ray driver's dispatch loop (``eval.ray._Dispatch``) against an in-process stand-in for Ray's task API (the real
cluster runs in tests/test_eval_ray.py when ray is installed): whole prompts to idle actors, rows appended as they
come, a failed task retried on another actor, then reported."""

from __future__ import annotations

from sdvg.eval.ray import _Dispatch


class _Ref:
    def __init__(self, worker, pid):
        self.worker, self.pid = worker, pid


class _Worker:
    def __init__(self, index, fails):
        self.index, self.fails, self.calls = index, fails, []
        self.run_prompt = self

    def remote(self, pid, prompt, rows, prior, seed=None):  # run_prompt.remote(...)
        self.calls.append(pid)
        return _Ref(self, pid)


class _Ray:
    def __init__(self, fails):
        self.fails = fails  # pid -> how many times its task fails

    def wait(self, refs, num_returns):
        return [refs[0]], refs[1:]

    def get(self, ref):
        if self.fails.get(ref.pid, 0) > 0:
            self.fails[ref.pid] -= 1
            raise RuntimeError(f"actor died\nworker {ref.worker.index} lost p{ref.pid}")
        return [{"prompt_id": str(ref.pid), "method": "sdvg"}]


class _Results:
    def __init__(self):
        self.rows = []

    def append(self, row):
        self.rows.append(row)


def test_dispatch_retries_on_another_actor_then_reports():
    ray = _Ray({1: 1, 2: 5})  # p1 fails once, p2 always
    workers = [_Worker(0, ray), _Worker(1, ray)]
    results, logged = _Results(), []
    todo = [(p, "sdvg", None) for p in range(4)]
    dispatch = _Dispatch(ray, workers, ["a", "b", "c", "d"], todo, results, 2, logged.append)
    dispatch.run([0, 1, 2, 3])
    assert [r["prompt_id"] for r in results.rows] == ["0", "3", "1"]  # in the order they finished
    assert dispatch.written == 3 and dispatch.failed == {2: "RuntimeError: worker 0 lost p2"}  # the error's last line
    assert [w.calls for w in workers] == [[0, 2, 1, 2], [1, 3, 2]]  # p1's retry ran on the other actor
    assert sum(w.calls.count(2) for w in workers) == 3  # one try and two retries
    assert sum(w.calls.count(1) for w in workers) == 2
    assert any("p2 FAILED after 3 tries" in m for m in logged) and any("retry 1/2" in m for m in logged)
    assert not dispatch.running and sorted(dispatch.idle) == [0, 1]  # every actor handed back
