"""``python -m sdvg eval``: quality-vs-speed evaluation over a prompt file, resumable.

For every prompt (one per line; blank lines and lines starting with ``#`` are skipped) it runs, in this order:

1. ``target-only`` — the reference for speed and quality;
2. ``draft-only``;
3. ``target0-draft``: block 0 by the target, every later block the drafter's, nothing scored: the cheapest way to
   keep the target's composition, the baseline that reward routing must beat to earn its scoring cost;
4. ``sdvg`` at every τ of ``--taus`` (reward routing, worst-frame ImageReward vs τ);
5. ``random`` at matched acceptance for every τ, **block 0 protected** (the target's, as in ``sdvg``): exactly as many
   accepted drafts as ``sdvg`` at that τ accepted on the same prompt, at blocks drawn at random (the router's
   ``pattern`` mode; ``router_seed`` is the draw's seed), so reward routing is compared with random routing at equal
   cost;
6. ``refine`` at every τ (only when asked for): reward routing where a rejected block is *refined* — the target
   continues the drafter's trajectory from step k (half the schedule's steps) instead of regenerating from noise
   (``SamplerConfig.refine_from_step``).

Each row: wall time, speedup (target-only wall / row wall, same prompt, same process), acceptance, the ImageReward
of every output frame against the prompt (mean and min), retention relative to target-only (mean ImageReward ratio,
only defined when the target-only mean is positive: ImageReward is a z-score and can be negative, so the difference
``ir_delta`` is reported too), and any external metrics. Videos go to ``<out>/videos/`` (written to a temporary file
and renamed, so a video is either complete or absent), rows to ``<out>/results.csv`` (appended and fsynced one row at
a time). Rerunning with the same ``--out`` skips every finished (prompt, method, τ) row: an interrupted evaluation
loses at most the row in progress. ``summary.csv`` (means with bootstrap 95 % intervals over prompts, seeded, for the
speedup and the quality columns) and the Pareto plot ``pareto.png`` are rewritten at the end (``eval_summary.py``).

External video metrics (VisionReward, VBench, …) plug in with ``--metric module:callable`` (repeatable). The callable
(or a class, instantiated without arguments) follows :class:`VideoMetric`: it gets the output frames ``[F, H, W, 3]``
float in [0, 1] (CPU) and the prompt and returns ``{name: float}``; each name becomes a CSV column ``m_<name>``. Only
modules named explicitly on the command line are imported. ``sdvg.eval.run:temporal_flicker`` is a built-in example.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ConfigError
from ..loaders.file_checks import broken_link
from ..outputs.video import write_mp4
from .folder import (
    PARETO,
    RESULTS,
    SUMMARY,
    ResultsFile,
    check_out_dir,
    check_run_settings,
    run_settings,
    tau_key,
)
from .paired import PAIRED, format_paired, paired_differences, write_paired
from .summary import METRIC_PREFIX, format_summary, render_pareto, summarize, write_summary
from .summary import cell as _cell
from .summary import num as _num

logger = logging.getLogger(__name__)

DEFAULT_TAUS = (-2.5, -1.5, -0.7, -0.2)
METHODS = ("target-only", "draft-only", "target0-draft", "sdvg", "random", "refine", "sdvg-rate", "random-rate")
DEFAULT_METHODS = METHODS[:5]
#: the reward-routed method whose acceptance each random method matches (block 0 protected in both)
MATCHED = {"random": "sdvg", "random-rate": "sdvg-rate"}
SWEPT = ("sdvg", "random", "refine")  # run at every τ; sdvg-rate / random-rate at every target rate
__all__ = ["METHODS", "evaluate", "format_paired", "format_summary", "render_pareto", "summarize", "write_summary"]


@runtime_checkable
class VideoMetric(Protocol):
    """An external per-video metric. ``names`` (optional) declares the returned keys up front."""

    def __call__(self, frames: torch.Tensor, prompt: str) -> Mapping[str, float]: ...


def temporal_flicker(frames: torch.Tensor, prompt: str) -> dict[str, float]:
    """Example metric: mean absolute difference of consecutive frames (0 = static; high = flicker or fast motion)."""
    del prompt
    return {"flicker": float((frames[1:] - frames[:-1]).abs().mean()) if frames.shape[0] >= 2 else 0.0}


temporal_flicker.names = ("flicker",)  # type: ignore[attr-defined]


def load_metric(spec: str) -> tuple[str, Callable]:
    """``module:attr`` → (label, callable). A class is instantiated without arguments."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--metric must look like module:callable (e.g. sdvg.eval.run:temporal_flicker), got {spec!r}.")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--metric {spec}: cannot import module {module_name!r} ({exc}).") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--metric {spec}: {module_name} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    obj = obj() if isinstance(obj, type) else obj
    if not callable(obj):
        raise ConfigError(f"--metric {spec}: {attr!r} is not callable.")
    return spec, obj


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a UTF-8 text file, one a line (blank lines and '#' comments skipped; a BOM is ignored)."""
    p = Path(path)
    if not p.is_file():
        problem = broken_link(p) or (f"The prompt file {p} is a folder." if p.is_dir() else f"No prompt file {p}.")
        raise ConfigError(f"{problem} Pass a text file with one prompt per line.")
    try:
        text = (data := p.read_bytes()).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"The prompt file {p} is not UTF-8 text (byte {data[exc.start]:#04x} on line {line}; probably Latin-1 or "
            f"Windows-1252). Save it as UTF-8 (an editor's 'Save as… UTF-8', or `iconv -f latin1 -t utf-8 {p} -o "
            f"{p.stem}-utf8{p.suffix}`) and pass that file."
        ) from None
    prompts = [x for x in (line.strip() for line in text.splitlines()) if x and not x.startswith("#")]
    if not prompts:
        raise ConfigError(f"The prompt file {p} has no prompts (one per line; '#' starts a comment).")
    return prompts


def check_eval_args(limit: int | None = None, max_rows: int | None = None) -> None:
    """``--limit`` and ``--max-rows``: None (all) or a whole number ≥ 1; 0 or a negative never means "all"."""
    for option, value, what in (("--limit", limit, "prompts"), ("--max-rows", max_rows, "new rows")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{option} must be a whole number ≥ 1 (how many {what} to run), got {value!r}. Leave "
                              f"it out to run all {what}.")


def parse_taus(text: str, flag: str = "--taus") -> tuple[float, ...]:
    """Comma-separated numbers (τ, or target rates with ``flag`` "--rates": the error names the flag given)."""
    try:
        taus = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"{flag} must be comma-separated numbers, got {text!r}.") from exc
    if not taus or any(not math.isfinite(t) for t in taus):
        raise ConfigError(f"{flag} needs finite numbers, got {text!r}.")
    return taus


# ----------------------------------------------------------------------------------------------------------
# one row


def _pattern_string(blocks) -> str:
    return "".join("A" if r.produced_by == "drafter" else ("R" if r.drafted else "T") for r in blocks)



def score_video(reward, frames: torch.Tensor, prompt: str, chunk: int = 16) -> tuple[float, float]:
    scores = reward.score(frames, prompt, chunk_size=chunk)
    return float(scores.mean()), float(scores.min())


def run_row(models, prompt: str, prompt_id: int, method: str, tau: float | None, *, config, router,
            out_dir: Path, reference: Mapping[str, str] | None, metrics, embeds, save_video: bool = True,
            pool: list[float] | None = None) -> dict:
    from ..sampling.sampler import SpeculativeSampler
    from .real_cost import RealCostTally

    sampler = SpeculativeSampler(models, router, config, pooled_scores=pool)  # pool: compat threshold_state pooled
    tally = RealCostTally()
    start = time.perf_counter()
    result = sampler.run(prompt, prompt_embeds=embeds, observers=(tally,))
    wall = time.perf_counter() - start
    frames = result.frames
    if frames.dtype == torch.uint8:
        frames = frames.float() / 255.0
    ir_mean, ir_min = score_video(models.reward, frames, prompt)
    drafted = sum(1 for r in result.blocks if r.drafted)
    accepted = sum(1 for r in result.blocks if r.drafted and r.decision == "accept")
    video = None
    if save_video:
        name = f"p{prompt_id:04d}_{method}{'_tau' + tau_key(tau) if tau is not None else ''}.mp4"
        video = write_mp4(frames, out_dir / "videos" / name)  # atomic: a video is complete or absent
    ref_wall = _num(reference.get("wall_s")) if reference else (wall if method == "target-only" else None)
    ref_ir = _num(reference.get("ir_mean")) if reference else (ir_mean if method == "target-only" else None)
    ref_macs = _num(reference.get("real_tmacs")) if reference else (tally.total if method == "target-only" else None)
    row = {
        "prompt_id": prompt_id, "method": method, "tau": tau_key(tau), "prompt": prompt, "seed": config.seed,
        "blocks": config.num_blocks, "wall_s": wall, "speedup": (ref_wall / wall) if ref_wall else None,
        "acceptance": (accepted / drafted) if drafted else None, "accepted": accepted, "drafted": drafted,
        "pattern": _pattern_string(result.blocks), "ir_mean": ir_mean, "ir_min": ir_min,
        "ir_retention": (ir_mean / ref_ir) if ref_ir is not None and ref_ir > 0 else None,
        "ir_delta": (ir_mean - ref_ir) if ref_ir is not None else None,
        "router_seed": router.seed if router.mode == "pattern" else None,
        "video": str(video.relative_to(out_dir)) if video is not None else None,
        "real_tmacs": tally.total, "speedup_real": (ref_macs / tally.total) if ref_macs and tally.total else None,
    }
    cpu_frames = frames.detach().float().cpu()
    for _label, metric in metrics:
        values = metric(cpu_frames, prompt)
        for k, val in dict(values).items():
            row[METRIC_PREFIX + str(k)] = float(val)
    return row


# ----------------------------------------------------------------------------------------------------------
# the evaluation


def plan_rows(n_prompts: int, taus: Sequence[float], methods: Sequence[str],
              rates: Sequence[float] = ()) -> list[tuple[int, str, float | None]]:
    """The (prompt id, method, τ) rows in run order: per prompt target-only, draft-only, target0-draft, sdvg τ…,
    random τ…, refine τ…, then sdvg-rate and random-rate at every target rate (their τ column holds the rate)."""
    rows = []
    for pid in range(n_prompts):
        rows += [(pid, m, None) for m in ("target-only", "draft-only", "target0-draft") if m in methods]
        rows += [(pid, m, t) for m in SWEPT if m in methods for t in taus]
        rows += [(pid, m, r) for m in ("sdvg-rate", "random-rate") if m in methods for r in rates]
    return rows


def evaluate(models, prompts: Sequence[str], out_dir: str | Path, *, taus: Sequence[float] = DEFAULT_TAUS,
             methods: Sequence[str] = DEFAULT_METHODS, sampler_config=None,
             metrics: Sequence[tuple[str, Callable]] = (), max_rows: int | None = None, save_videos: bool = True,
             warmup: bool = True, log: Callable[[str], None] | None = None, rates: Sequence[float] = (),
             seeds: Sequence[int] | None = None, rate_router: Mapping[str, float] | None = None,
             score_frames: int = 0, provenance: Mapping[str, Any] | None = None) -> dict:
    """Run (or resume) the evaluation; returns {"written": n, "skipped": n, "complete": bool, "summary": [...]}.

    ``rates``: the target acceptance rates of the sdvg-rate / random-rate rows (the router's target-rate threshold,
    a quantile of the block scores seen so far in this run, pooled over its videos; ``rate_router``: that router's
    prior, e.g. ``{"prior_mean": …, "prior_std": …}``). ``seeds``: one sampling seed per prompt (default: the
    sampler config's seed for all), so a (caption, seed) pair is one prompt id. ``score_frames``: the reward rows
    (sdvg, sdvg-rate, refine) score only that many frames spread over each block (0 = every frame; the router's
    ``score_frames``). ``provenance``: where the models came from (the CLI's files and tree), recorded with the
    settings in ``eval_settings.json``: a rerun into the same folder with other settings is refused
    (:func:`check_run_settings`)."""
    from ..sampling.sampler import SamplerConfig

    _check_inputs(models, prompts, taus, methods, max_rows, rates, score_frames)
    if seeds is not None and len(seeds) != len(prompts):
        raise ConfigError(f"{len(seeds)} seeds for {len(prompts)} prompts: pass one seed per prompt.")
    out = check_out_dir(out_dir)  # before any row runs
    for stale in (out / "videos").glob(".*.tmp.mp4") if (out / "videos").is_dir() else []:
        stale.unlink()
    config = sampler_config or SamplerConfig(num_blocks=3, width=64, height=64)
    check_run_settings(out, run_settings(config, score_frames, rate_router, provenance))
    results = ResultsFile(out / RESULTS, _declared_names(metrics))
    plan = plan_rows(len(prompts), taus, methods, rates)
    done = results.done()
    todo = [r for r in plan if (str(r[0]), r[1], tau_key(r[2])) not in done]
    written = 0
    runner = PromptRunner(models, config, out, metrics=metrics, save_videos=save_videos, log=log,
                          routing=RewardRouting(score_frames, dict(rate_router or {})))
    if todo and warmup:
        runner.warm_up(prompts[todo[0][0]])
    for pid in dict.fromkeys(r[0] for r in todo):
        if max_rows is not None and written >= max_rows:
            break
        mine = [r for r in todo if r[0] == pid]
        rows = runner.rows(pid, prompts[pid], mine, [r for r in results.rows if r["prompt_id"] == str(pid)],
                           seed=None if seeds is None else int(seeds[pid]))
        for row in rows:
            results.append(row)
            written += 1
            if max_rows is not None and written >= max_rows:
                rows.close()
                break
    complete = results.done() >= {(str(p), m, tau_key(t)) for p, m, t in plan}
    summary = summarize(results.rows)
    write_summary(summary, out / SUMMARY)
    render_pareto(summary, out / PARETO)
    paired = paired_differences(results.rows)
    write_paired(paired, out / PAIRED)
    return {"written": written, "skipped": len(plan) - len(todo), "complete": complete, "summary": summary,
            "paired": paired, "results": str(out / RESULTS)}


@dataclass(frozen=True)
class RewardRouting:
    """How the reward rows (sdvg, refine, sdvg-rate) route, besides their τ or rate: ``score_frames`` frames scored a
    block (0 = every frame; the router's ``score_frames``) and the target-rate router's prior (``rate``, e.g.
    ``{"prior_mean": …, "prior_std": …}``; sdvg-rate only). One value for a whole run, recorded in its settings."""

    score_frames: int = 0
    rate: Mapping[str, float] = field(default_factory=dict)

    def router(self, method: str, tau: float):
        """The router of a reward row at ``tau`` (a threshold, or for sdvg-rate an acceptance rate)."""
        from ..sampling.router import RouterConfig

        if method == "sdvg-rate":
            return RouterConfig(mode="reward", aggregation="min", threshold="target-rate", target_rate=tau,
                                score_frames=self.score_frames, **self.rate)
        return RouterConfig(mode="reward", tau=tau, aggregation="min", threshold="fixed", score_frames=self.score_frames)


class PromptRunner:
    """Runs the missing rows of one prompt at a time on loaded models, in plan order (target-only first: the later
    rows' speedups refer to it; random after sdvg: it matches sdvg's acceptance). The single-process evaluation and
    each Ray actor (``eval_ray.py``) use it. ``pools``: the run-wide target-rate score pools (compat "pooled")."""

    def __init__(self, models, config, out: Path, *, metrics=(), save_videos: bool = True, log=None,
                 routing: RewardRouting | None = None) -> None:
        self.models, self.config, self.out, self.metrics = models, config, out, metrics
        self.save_videos, self.log = save_videos, log
        self.routing = routing or RewardRouting()
        self.pools: dict[tuple[str, str], list[float]] = {}

    def config_for(self, method: str, seed: int | None = None):
        """The sampler config of a method (and seed): refine-on-reject continues a rejected draft from half its
        steps (both models on the target's schedule, a drafter's own schedule set aside); the target-rate rows pool their threshold statistics over the run's videos."""
        from dataclasses import replace

        cfg = self.config if seed is None else replace(self.config, seed=int(seed))
        if method == "sdvg-rate":
            cfg = replace(cfg, compat=replace(cfg.compat, threshold_state="pooled"))
        if method != "refine":
            return cfg if cfg is self.config else cfg.validate()
        steps = max(len(row) for row in cfg.step_schedule())  # one schedule for both models: the target's
        return replace(cfg, refine_from_step=max(1, steps // 2), drafter_schedule=None,
                       drafter_step_noise=None).validate()

    def warm_up(self, prompt: str) -> None:
        _warm_up(self.models, self.config, prompt, self.models.text_encoder.encode(prompt))

    def router(self, pid: int, method: str, tau: float | None, known: Mapping[tuple[str, str], Mapping[str, str]]):
        from ..sampling.router import RouterConfig, random_pattern

        if method in ("target-only", "draft-only"):
            return RouterConfig(mode=method)
        if method == "target0-draft":  # block 0 is the target's (force_reject_first), every drafted block accepted
            return RouterConfig(mode="pattern", pattern=(True,) * (self.config.num_blocks - 1))
        if method in ("sdvg", "refine", "sdvg-rate"):
            return self.routing.router(method, float(tau))
        matched = known.get((MATCHED[method], tau_key(tau)))
        if matched is None:
            return None
        accepted, drafted = int(matched["accepted"]), int(matched["drafted"])
        # random routing at exactly the acceptance reward routing reached: as many accepts, at random blocks
        return RouterConfig(mode="pattern", pattern=random_pattern(drafted, accepted, seed=pid), seed=pid)

    def rows(self, pid: int, prompt: str, todo, done_rows: Sequence[Mapping[str, str]], seed: int | None = None):
        """Yield the new rows of prompt ``pid`` (``todo``: its (pid, method, τ) rows not yet in ``done_rows``),
        sampled with ``seed`` (default: the config's)."""
        known = {(r["method"], r["tau"]): r for r in done_rows}
        embeds = self.models.text_encoder.encode(prompt)
        for _, method, tau in todo:
            router = self.router(pid, method, tau, known)
            if router is None:
                if self.log:
                    self.log(f"  skip p{pid} {method} τ={tau_key(tau)}: no {MATCHED[method]} row to match")
                continue
            row = run_row(self.models, prompt, pid, method, tau, config=self.config_for(method, seed), router=router,
                          out_dir=self.out,
                          reference=known.get(("target-only", "")), metrics=self.metrics, embeds=embeds,
                          save_video=self.save_videos, pool=self.pools.setdefault((method, tau_key(tau)), []))
            known[(method, tau_key(tau))] = {k: _cell(v) for k, v in row.items()}
            if self.log:
                acc = row["acceptance"]
                self.log(f"  p{pid} {method:13s} τ={tau_key(tau) or '—':5s} wall {row['wall_s']:.2f}s "
                         f"speedup {row['speedup'] or 0:.2f}× acc {'—' if acc is None else f'{acc:.0%}'} "
                         f"IR mean {row['ir_mean']:+.3f} min {row['ir_min']:+.3f}")
            yield row


def _check_inputs(models, prompts: Sequence[str], taus: Sequence[float], methods: Sequence[str], max_rows,
                  rates: Sequence[float] = (), score_frames: int = 0) -> None:
    check_plan(prompts, taus, methods, max_rows, rates, score_frames)
    if models.reward is None:
        raise ConfigError("The evaluation scores every output with ImageReward; no reward model was given.")


def check_score_frames(score_frames: int) -> None:
    """The reward rows' scored frames per block, checked by the router's own rule before any row runs."""
    from ..sampling.router import RouterConfig

    RouterConfig(mode="reward", score_frames=score_frames).validate()


def check_plan(prompts: Sequence[str], taus: Sequence[float], methods: Sequence[str], max_rows,
               rates: Sequence[float] = (), score_frames: int = 0) -> None:
    """Refuse an evaluation that cannot run as asked, from its arguments alone (the CLI calls it before loading)."""
    check_score_frames(score_frames)
    if not prompts or "target-only" not in methods or not set(methods) <= set(METHODS):
        raise ConfigError(f"Nothing to compare: {len(prompts)} prompt(s), methods {list(methods)}. Pass prompts and "
                          f"some of {', '.join(METHODS)}, target-only among them (speedups are relative to it).")
    if not taus and {"sdvg", "random", "refine"} & set(methods):
        raise ConfigError("The sdvg, random and refine methods run at each τ and no τ was given: pass taus (e.g. -0.7).")
    if {"sdvg-rate", "random-rate"} & set(methods) and not rates:
        raise ConfigError("The sdvg-rate and random-rate methods run at each target rate and none was given: pass "
                          "rates (e.g. 0.25,0.5,0.75).")
    if any(not 0.0 < r < 1.0 for r in rates):
        raise ConfigError(f"Target rates are acceptance fractions strictly between 0 and 1, got {list(rates)}.")
    check_eval_args(max_rows=max_rows)


def _declared_names(metrics) -> list[str] | None:
    names: list[str] = []
    for _label, m in metrics:
        declared = getattr(m, "names", None)
        if declared is None:
            return None
        names += [str(n) for n in declared]
    return names


def _warm_up(models, config, prompt: str, embeds) -> None:
    """One short untimed run of each model path so the first timed row does not pay first-call costs: two blocks, or
    as many as the schedules give distinct lists (a per-block list longer than the short run is no error)."""
    from dataclasses import replace

    from ..sampling.router import RouterConfig
    from ..sampling.sampler import SpeculativeSampler

    lists = max(len(config.step_schedule(role, distinct=True)) for role in ("target", "drafter"))
    cfg = replace(config, num_blocks=min(max(2, lists), config.num_blocks), num_frames=None)
    for router in (RouterConfig(mode="target-only"), RouterConfig(mode="reward", tau=-math.inf)):
        SpeculativeSampler(models, router, cfg).run(prompt, prompt_embeds=embeds)
    models.reward.score(torch.zeros((1, config.height, config.width, 3)), prompt)
