"""Reward routing minus matched random routing, paired by prompt, with a bootstrap interval, at every acceptance level.

Unpaired intervals of two rows hide what pairing shows: both rows ran on the same (prompt, seed) with block 0 the
target's and the same number of accepted drafts, so their difference per prompt removes the prompt's own difficulty.
For every reward-routed row (``sdvg`` at a τ, ``sdvg-rate`` at a target rate) and its matched random row
(``random`` / ``random-rate``, same τ column): per prompt text, the mean over its seeds of quality(reward) −
quality(random); the mean over prompts, and a percentile bootstrap interval that resamples prompts (so two seeds of
one caption count as one prompt, not two independent draws). Quality is the world judge's caption accuracy when it
was measured (``m_judge``), else the mean ImageReward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from .stats import bootstrap_ci, mean_or_none
from .summary import JUDGE, METRIC_PREFIX, num, write_csv

PAIRS = {"sdvg": "random", "sdvg-rate": "random-rate"}
PAIRED = "paired.csv"
COLUMNS = ("method", "tau", "versus", "prompts", "pairs", "acceptance", "quality", "reward", "random", "diff",
           "diff_lo", "diff_hi")


def _quality(rows: Sequence[Mapping[str, str]]) -> str:
    judge = METRIC_PREFIX + JUDGE
    return judge if rows and all(num(r.get(judge)) is not None for r in rows) else "ir_mean"


def paired_differences(rows: Sequence[Mapping[str, str]], *, seed: int = 0) -> list[dict]:
    """One item per (reward method, τ) that has matched random rows: the paired difference and its interval."""
    quality = _quality(rows)
    by_key = {(r["prompt_id"], r["method"], r["tau"]): r for r in rows}
    out = []
    for method, versus in PAIRS.items():
        for tau in sorted({r["tau"] for r in rows if r["method"] == method}, key=lambda t: num(t) or 0.0):
            per_prompt: dict[str, list[tuple[float, float, float]]] = {}
            for (pid, m, t), r in by_key.items():
                other = by_key.get((pid, versus, t))
                if m != method or t != tau or other is None:
                    continue
                a, b = num(r.get(quality)), num(other.get(quality))
                if a is not None and b is not None:
                    per_prompt.setdefault(r["prompt"], []).append((a, b, num(r.get("acceptance")) or 0.0))
            if not per_prompt:
                continue
            items = [[sum(x[i] for x in v) / len(v) for i in range(3)] for v in per_prompt.values()]
            diffs = [a - b for a, b, _ in items]
            lo, hi = bootstrap_ci(diffs, mean_or_none, seed=seed) or (None, None)
            out.append({"method": method, "tau": tau, "versus": versus, "prompts": len(items),
                        "pairs": sum(len(v) for v in per_prompt.values()),
                        "acceptance": mean_or_none([x[2] for x in items]), "quality": quality,
                        "reward": mean_or_none([x[0] for x in items]), "random": mean_or_none([x[1] for x in items]),
                        "diff": mean_or_none(diffs), "diff_lo": lo, "diff_hi": hi})
    return out


def write_paired(items: Sequence[dict], path: Path) -> Path:
    return write_csv(items, COLUMNS, path)


def format_paired(items: Sequence[dict]) -> str:
    if not items:
        return "paired reward − random: no matched rows"
    lines = [f"paired by prompt: reward routing − matched random routing (block 0 protected), {items[0]['quality']}",
             f"{'method':10s} {'τ/rate':>7s} {'prompts':>7s} {'accept':>7s} {'reward':>7s} {'random':>7s} "
             f"{'diff':>7s} {'95% CI':>18s}"]
    for it in items:
        ci = "—" if it["diff_lo"] is None else f"[{it['diff_lo']:+.3f}, {it['diff_hi']:+.3f}]"
        lines.append(f"{it['method']:10s} {it['tau']:>7s} {it['prompts']:7d} {it['acceptance']:7.0%} "
                     f"{it['reward']:7.3f} {it['random']:7.3f} {it['diff']:+7.3f} {ci:>18s}")
    lines.append("95% CI: bootstrap over prompts (2000 resamples, seeded; a prompt's seeds averaged first)")
    return "\n".join(lines)
