"""``sdvg eval --ray auto|ADDRESS``: the evaluation spread over a Ray cluster (optional extra: ``pip install ".[ray]"``).

One actor per GPU (or ``actors`` CPU actors) loads the models once and runs whole prompts as tasks (every missing row
of a prompt, in plan order: the target-only reference first, random after the sdvg row it matches), through the same
:class:`~sdvg.evaluate.PromptRunner` as the single-process run. The driver appends each finished prompt's rows to the
same resumable ``results.csv`` (rerunning skips finished rows, as without Ray), logs progress, retries a failed
prompt on another actor up to ``retries`` times and reports the prompts that still failed. Videos are written by the
actors into ``<out>/videos``, so a multi-node cluster needs ``--out`` on a shared filesystem. Speedups compare rows
of one prompt, which always run on one actor, so they do not mix machines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError

RAY_HINT = "Ray is an optional extra: pip install '.[ray]' (or pip install ray), then rerun with --ray."


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"--ray needs the ray package, which is not installed. {RAY_HINT}") from exc
    return ray


class _EvalWorker:
    """A Ray actor's state: the models, loaded once, and a PromptRunner."""

    def __init__(self, load_kwargs: Mapping[str, Any], config, out: str, metric_specs: Sequence[str],
                 save_videos: bool, warmup: bool, score_frames: int = 0) -> None:
        from ..devices import set_cpu_threads
        from ..loaders.bundle import load_models
        from .run import PromptRunner, RewardRouting, load_metric

        set_cpu_threads(load_kwargs.get("threads"), 1)
        models = load_models(**{k: v for k, v in load_kwargs.items() if k != "threads"})
        self.runner = PromptRunner(models, config, Path(out), metrics=[load_metric(m) for m in metric_specs],
                                   save_videos=save_videos, routing=RewardRouting(score_frames))
        self.warm = not warmup

    def run_prompt(self, pid: int, prompt: str, todo: list, done_rows: list, seed: int | None = None) -> list[dict]:
        if not self.warm:
            self.runner.warm_up(prompt)
            self.warm = True
        return list(self.runner.rows(pid, prompt, todo, done_rows, seed=seed))


def evaluate_ray(address: str, load_kwargs: Mapping[str, Any], prompts: Sequence[str], out_dir: str | Path, *,
                 taus: Sequence[float], methods: Sequence[str], sampler_config, metric_specs: Sequence[str] = (),
                 actors: int | None = None, retries: int = 2, save_videos: bool = True, warmup: bool = True,
                 log: Callable[[str], None] | None = None, seeds: Sequence[int] | None = None,
                 score_frames: int = 0, rate_router: Mapping[str, float] | None = None,
                 provenance: Mapping[str, Any] | None = None) -> dict:
    """The Ray twin of :func:`sdvg.evaluate.evaluate` (same CSV, summary and plot). ``address``: "auto" (the
    cluster in ``RAY_ADDRESS``, else a local one) or a cluster address; ``load_kwargs``: ``load_models``'
    arguments, ``metric_specs``: ``--metric`` strings (each actor imports them); ``seeds``: one per prompt;
    ``score_frames``, ``rate_router`` (recorded only) and ``provenance``: as in ``evaluate``. The
    target-rate rows (sdvg-rate) are not run on Ray: their threshold pools the scores of one process's videos."""
    from . import folder
    from . import run as ev

    ray = import_ray()
    if retries < 0:
        raise ConfigError(f"retries must be >= 0, got {retries}.")
    ev.check_score_frames(score_frames)
    out = folder.check_out_dir(out_dir)
    folder.check_run_settings(out, folder.run_settings(sampler_config, score_frames, rate_router, provenance))
    metrics = [ev.load_metric(m) for m in metric_specs]  # a bad --metric fails here, before the cluster starts
    results = folder.ResultsFile(out / folder.RESULTS, ev._declared_names(metrics))
    plan = ev.plan_rows(len(prompts), taus, methods)
    done = results.done()
    todo = [r for r in plan if (str(r[0]), r[1], folder.tau_key(r[2])) not in done]
    pids = list(dict.fromkeys(r[0] for r in todo))
    if not ray.is_initialized():
        ray.init(address=None if address == "auto" else address, ignore_reinit_error=True,
                 log_to_driver=False, configure_logging=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    remote = ray.remote(num_gpus=1 if gpus else 0, num_cpus=1, max_restarts=1)(_EvalWorker)
    workers = [remote.remote(dict(load_kwargs), sampler_config, str(out), list(metric_specs), save_videos, warmup,
                             score_frames)
               for _ in range(min(actors or gpus or 1, max(1, len(pids))))]  # one actor per GPU unless told
    if log:
        log(f"eval on Ray: {len(pids)} prompt(s) to run on {len(workers)} actor(s) "
            f"({gpus} GPU(s) in the cluster), {len(plan) - len(todo)} row(s) already done")
    dispatch = _Dispatch(ray, workers, prompts, todo, results, retries, log, seeds)
    dispatch.run(pids)
    complete = results.done() >= {(str(p), m, folder.tau_key(t)) for p, m, t in plan}
    summary = ev.summarize(results.rows)
    ev.write_summary(summary, out / folder.SUMMARY)
    ev.render_pareto(summary, out / folder.PARETO)
    return {"written": dispatch.written, "skipped": len(plan) - len(todo), "complete": complete, "summary": summary,
            "results": str(out / folder.RESULTS), "failed": dispatch.failed}


class _Dispatch:
    """Whole prompts handed to idle actors; each finished prompt's rows appended to the CSV as they come; a failed
    task retried on another actor up to ``retries`` times, then reported."""

    def __init__(self, ray, workers, prompts, todo, results, retries: int, log, seeds=None) -> None:
        self.ray, self.workers, self.prompts, self.todo, self.results = ray, workers, prompts, todo, results
        self.seeds = seeds  # one per prompt, or None (the sampler config's seed)
        self.retries, self.log = retries, log or (lambda _msg: None)
        self.tries: dict[int, int] = {}
        self.failed: dict[int, str] = {}
        self.running: dict[Any, tuple[int, int]] = {}  # task ref -> (pid, worker index)
        self.idle = list(range(len(workers)))
        self.written = 0

    def run(self, pids: list[int]) -> None:
        queue, finished, start = list(pids), 0, time.perf_counter()
        self._submit(queue)
        while self.running:
            ready, _ = self.ray.wait(list(self.running), num_returns=1)
            pid, w = self.running.pop(ready[0])
            self.idle.append(w)
            try:
                rows = self.ray.get(ready[0])
            except Exception as exc:  # a task or actor failure: retried on another actor, then reported
                self._failed(pid, exc, queue)
            else:
                for row in rows:
                    self.results.append(row)
                self.written += len(rows)
                finished += 1
                self.log(f"  [{finished}/{len(pids)}] p{pid}: {len(rows)} row(s) ({time.perf_counter() - start:.0f}s)")
            self._submit(queue)
        for pid, why in self.failed.items():
            self.log(f"  p{pid} FAILED after {self.retries + 1} tries: {why}")

    def _submit(self, queue: list[int]) -> None:
        while queue and self.idle:
            pid, w = queue.pop(0), self.idle.pop(0)
            mine = [r for r in self.todo if r[0] == pid]
            prior = [r for r in self.results.rows if r["prompt_id"] == str(pid)]
            seed = None if self.seeds is None else int(self.seeds[pid])
            self.running[self.workers[w].run_prompt.remote(pid, self.prompts[pid], mine, prior, seed)] = (pid, w)

    def _failed(self, pid: int, exc: Exception, queue: list[int]) -> None:
        self.tries[pid] = self.tries.get(pid, 0) + 1
        if self.tries[pid] <= self.retries:
            queue.append(pid)
            self.log(f"  p{pid} failed ({type(exc).__name__}); retry {self.tries[pid]}/{self.retries}")
        else:
            text = str(exc).strip()
            self.failed[pid] = f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
