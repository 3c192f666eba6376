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
                 save_videos: bool, warmup: bool) -> None:
        from ..devices import set_cpu_threads
        from ..loaders.bundle import load_models
        from .run import PromptRunner, load_metric

        set_cpu_threads(load_kwargs.get("threads"), 1)
        models = load_models(**{k: v for k, v in load_kwargs.items() if k != "threads"})
        self.runner = PromptRunner(models, config, Path(out), metrics=[load_metric(m) for m in metric_specs],
                                   save_videos=save_videos)
        self.warm = not warmup

    def run_prompt(self, pid: int, prompt: str, todo: list, done_rows: list, seed: int | None = None) -> list[dict]:
        if not self.warm:
            self.runner.warm_up(prompt)
            self.warm = True
        return list(self.runner.rows(pid, prompt, todo, done_rows, seed=seed))


def evaluate_ray(address: str, load_kwargs: Mapping[str, Any], prompts: Sequence[str], out_dir: str | Path, *,
                 taus: Sequence[float], methods: Sequence[str], sampler_config, metric_specs: Sequence[str] = (),
                 actors: int | None = None, retries: int = 2, save_videos: bool = True, warmup: bool = True,
                 log: Callable[[str], None] | None = None, seeds: Sequence[int] | None = None) -> dict:
    """The Ray twin of :func:`sdvg.evaluate.evaluate` (same CSV, summary and plot). ``address``: "auto" (the
    cluster in ``RAY_ADDRESS``, else a local one) or a cluster address; ``load_kwargs``: ``load_models``'
    arguments, ``metric_specs``: ``--metric`` strings (each actor imports them); ``seeds``: one per prompt. The
    target-rate rows (sdvg-rate) are not run on Ray: their threshold pools the scores of one process's videos."""
    from .run import (
        PARETO,
        RESULTS,
        SUMMARY,
        ResultsFile,
        _declared_names,
        check_out_dir,
        load_metric,
        plan_rows,
        render_pareto,
        summarize,
        tau_key,
        write_summary,
    )

    ray = import_ray()
    if retries < 0:
        raise ConfigError(f"retries must be >= 0, got {retries}.")
    out = check_out_dir(out_dir)
    metrics = [load_metric(m) for m in metric_specs]  # a bad --metric fails here, before the cluster starts
    results = ResultsFile(out / RESULTS, _declared_names(metrics))
    plan = plan_rows(len(prompts), taus, methods)
    done = results.done()
    todo = [r for r in plan if (str(r[0]), r[1], tau_key(r[2])) not in done]
    pids = list(dict.fromkeys(r[0] for r in todo))
    if not ray.is_initialized():
        ray.init(address=None if address == "auto" else address, ignore_reinit_error=True,
                 log_to_driver=False, configure_logging=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    n = actors or gpus or 1  # one actor per GPU unless told
    remote = ray.remote(num_gpus=1 if gpus else 0, num_cpus=1, max_restarts=1)(_EvalWorker)
    workers = [remote.remote(dict(load_kwargs), sampler_config, str(out), list(metric_specs), save_videos, warmup)
               for _ in range(min(n, max(1, len(pids))))]
    if log:
        log(f"eval on Ray: {len(pids)} prompt(s) to run on {len(workers)} actor(s) "
            f"({gpus} GPU(s) in the cluster), {len(plan) - len(todo)} row(s) already done")
    tries: dict[int, int] = {}
    failed: dict[int, str] = {}
    queue = list(pids)
    running: dict[Any, tuple[int, int]] = {}  # task ref -> (pid, worker index)
    idle = list(range(len(workers)))
    written, finished, start = 0, 0, time.perf_counter()

    def submit() -> None:
        while queue and idle:
            pid, w = queue.pop(0), idle.pop(0)
            mine = [r for r in todo if r[0] == pid]
            prior = [r for r in results.rows if r["prompt_id"] == str(pid)]
            seed = None if seeds is None else int(seeds[pid])
            running[workers[w].run_prompt.remote(pid, prompts[pid], mine, prior, seed)] = (pid, w)

    submit()
    while running:
        ready, _ = ray.wait(list(running), num_returns=1)
        pid, w = running.pop(ready[0])
        idle.append(w)
        try:
            rows = ray.get(ready[0])
        except Exception as exc:  # a task or actor failure: retried on another actor, then reported
            tries[pid] = tries.get(pid, 0) + 1
            if tries[pid] <= retries:
                queue.append(pid)
                if log:
                    log(f"  p{pid} failed ({type(exc).__name__}); retry {tries[pid]}/{retries}")
            else:
                failed[pid] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            submit()
            continue
        for row in rows:
            results.append(row)
            written += 1
        finished += 1
        if log:
            log(f"  [{finished}/{len(pids)}] p{pid}: {len(rows)} row(s) ({time.perf_counter() - start:.0f}s)")
        submit()
    for pid, why in failed.items():
        if log:
            log(f"  p{pid} FAILED after {retries + 1} tries: {why}")
    complete = results.done() >= {(str(p), m, tau_key(t)) for p, m, t in plan}
    summary = summarize(results.rows)
    write_summary(summary, out / SUMMARY)
    render_pareto(summary, out / PARETO)
    return {"written": written, "skipped": len(plan) - len(todo), "complete": complete, "summary": summary,
            "results": str(out / RESULTS), "failed": failed}
