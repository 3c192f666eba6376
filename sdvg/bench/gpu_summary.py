"""The figures of summary.json, read from what the GPU check's steps wrote (finished or partial JSON).

Every reader takes whatever is there: a missing file gives ``None``, a partial bench gives the runs it timed. On
``--cpu-smoke`` the same figures come from the tiny shapes on the CPU (``shapes: "tiny"``): they check the plumbing
and mean nothing about speed at real size.

- ``per_call_s``: median seconds per call kind (target = 14B block forward, drafter = 1.3B block forward, decode =
  VAE decode of one block, score = ImageReward over a block's frames, setup = cross-attention prep, encode = VAE
  re-encode) and per signature (frame offset, frames, cache write: the cache-writing forwards are the ones with
  ``write=True``), from the real-size bench's cost model;
- ``speedup``: per forced acceptance level, the measured speedup over target-only, the cost-model bound and their
  ratio (efficiency); ``pipelined``: pipelined vs plain at each level, and the share of the plain row's
  decode + score time that pipelining hid;
- ``offload``: seconds per 14B block forward with all 40 vs 9 resident blocks (fp8), peak GiB, bit-identical;
- ``peak_vram_gib``: per bench row (all models resident, bf16), the offload run, the training run, beside the 24 GiB
  card plan's line items (``card_plan_gib``) and the FSDP plan's one-GPU total;
- ``train``: seconds per iteration, peak memory and the plan's estimate;
- ``bit_exact``: each bit-identical check and whether it held (what they compare: :func:`describe_checks`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GIB = 2**30


def describe_checks() -> dict[str, str]:
    """What each bit-exact check compares, and the kernel-determinism caveat."""
    return {
        "reject_all_bit_exact_target_only": "the latents and frames of a reward-routed run at tau=+inf (every draft "
        "made, scored and discarded) against a target-only run, same seed, same process and device, per cache regime",
        "pipelined_equals_plain": "a pipelined-verification run (decode + score on a side CUDA stream) against a plain "
        "one with the same random router decisions",
        "offload_bit_identical": "a tiny bf16 target with 1 resident block and the side-stream prefetch against the "
        "same model all resident; real_14b: the random 14B in fp8 with 9 of 40 resident against all resident",
        "caveat": "bit-identity needs the same kernels for the same shapes: true on the CPU; on CUDA for SDPA's forward "
        "kernels and, with CUBLAS_WORKSPACE_CONFIG=:4096:8 (set by the check), for cuBLAS. A failure reports the max abs "
        "difference: ~1e-6 means a kernel choice, large means a logic error.",
    }


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _gib(nbytes: Any) -> float | None:
    return None if nbytes is None else round(float(nbytes) / GIB, 3)


def bench_figures(report: dict | None) -> dict:
    """Per-call times, speedup vs bound, pipelined vs plain, peak VRAM per row (from the bench JSON)."""
    if not report:
        return {}
    if report.get("partial"):
        runs = report.get("runs_done", {})
        return {"partial": True, "runs_done": {name: {"wall_s": rs[-1]["wall_s"], "call_s": rs[-1]["call_s"],
                                                      "cuda_peak_gib": _gib(rs[-1].get("cuda_peak_bytes"))}
                                               for name, rs in runs.items()}}
    cost = report.get("cost_model", {})
    rows = report.get("rows", [])
    out: dict[str, Any] = {
        "partial": False,
        "per_call_s": cost.get("pooled_per_call_s"),
        "per_call_s_by_regime": cost.get("per_call_s"),
        "per_signature_s": cost.get("per_signature_s"),
        "target_over_drafter_forward": cost.get("target_over_drafter_forward"),
        "speedup": [{"row": r["name"], "acceptance": r.get("acceptance"), "speedup": r.get("speedup"),
                     "bound": r.get("bound"), "efficiency": r.get("efficiency"), "wall_s": r.get("wall_s")}
                    for r in rows],
        "peak_vram_gib": {r["name"]: _gib(r.get("cuda_peak_bytes")) for r in rows},
        "machine": report.get("machine"),
    }
    out["pipelined"] = _pipelined(rows, report.get("goals", {}).get("pipelined") or {})
    return out


def _pipelined(rows: list[dict], gains: dict) -> dict:
    """Pipelined vs plain per level: walls, speedups, and the share of the plain row's decode + score it hid."""
    by_name = {r["name"]: r for r in rows}
    out = {}
    for level, g in gains.items():
        plain = by_name.get(f"scored @{level}")
        hidden = None
        if plain is not None:
            ds = sum((plain.get("call_s") or {}).get(k) or 0.0 for k in ("decode", "score"))
            hidden = (g["plain_s"] - g["pipelined_s"]) / ds if ds > 0 else None
        out[level] = {**g, "decode_score_hidden_share": hidden}
    return out


def offload_figures(report: dict | None) -> dict:
    if not report:
        return {}
    real = report.get("real_14b") or {}
    tiny = report.get("tiny") or {}
    return {"resident": real.get("resident"), "blocks": real.get("blocks"), "shape": real.get("shape"),
            "all_resident_s_per_forward": real.get("plain_s"), "offload_s_per_forward": real.get("offload_s"),
            "slowdown": (real["offload_s"] / real["plain_s"]) if real.get("plain_s") else None,
            "peak_all_resident_gib": real.get("peak_plain_gib"), "peak_offload_gib": real.get("peak_offload_gib"),
            "error": real.get("error") or tiny.get("error"),
            "lora_max_abs_diff_vs_cpu": tiny.get("lora_max_abs_diff_vs_cpu")}


def train_figures(report: dict | None) -> dict:
    if not report:
        return {}
    return {"partial": report.get("partial"), "steps": report.get("steps"), "s_per_iter": report.get("s_per_iter"),
            "peak_memory_gib": (report["peak_memory_mb"] / 1024) if report.get("peak_memory_mb") else None,
            "plan_total_gib_1gpu": report.get("plan_total_gib_1gpu"), "shape": report.get("shape")}


def plan_figures(report: dict | None) -> dict:
    """The 24 GiB card plan's line items (GiB) and its resident-block count per cache regime."""
    card = ((report or {}).get("memory_plan") or {}).get("card_plan")
    if not card:
        return {}
    return {"card_gib": _gib(card["card_bytes"]), "items_gib": {k: _gib(v) for k, v in card["fixed"].items()},
            "block_gib": _gib(card["block_bytes"]),
            "regimes": {k: {"kv_gib": _gib(v["kv_bytes"]), "resident_blocks": v["resident_blocks"], "fits": v["fits"]}
                        for k, v in card["regimes"].items()}}


def bit_exact(smoke: dict | None, offload: dict | None) -> dict:
    out: dict[str, Any] = {}
    for name, c in ((smoke or {}).get("checks") or {}).items():
        if "bit_exact" in name or "equals" in name:
            out[name] = {"held": c.get("passed"), "max_abs_latent_diff": c.get("max_abs_latent_diff"),
                         "error": c.get("error")}
    if offload:
        if "tiny" in offload:
            out["offload_bit_identical[tiny]"] = {"held": offload["tiny"].get("offload_bit_identical")}
        if "real_14b" in offload:
            out["offload_bit_identical[real_14b]"] = {"held": offload["real_14b"].get("bit_identical")}
    return out


def collect_figures(out: Path, work: Path, cpu_smoke: bool) -> dict:
    """Every figure the check reports, from the files under ``out`` (and the plan in ``work``)."""
    smoke, bench = _load(out / "cuda_smoke.json"), _load(out / "real_size.json")
    offload, train, plan = _load(out / "offload.json"), _load(out / "train.json"), _load(work / "plan.json")
    figs: dict[str, Any] = {"shapes": "tiny (CPU smoke: plumbing only, not real-size speed)" if cpu_smoke else "real"}
    figs["bench"] = bench_figures(bench)
    figs["offload"] = offload_figures(offload)
    figs["train"] = train_figures(train)
    figs["card_plan_gib"] = plan_figures(plan)
    figs["bit_exact"] = bit_exact(smoke, offload)
    figs["smoke_checks"] = {k: v.get("passed") for k, v in ((smoke or {}).get("checks") or {}).items()}
    figs["peak_vram_gib"] = {
        "bench_rows_all_resident_bf16": figs["bench"].get("peak_vram_gib"),
        "offload_14b_fp8": {"all_resident": figs["offload"].get("peak_all_resident_gib"),
                            "resident_9_of_40": figs["offload"].get("peak_offload_gib")},
        "train": figs["train"].get("peak_memory_gib"),
        "train_plan_1gpu": figs["train"].get("plan_total_gib_1gpu"),
        "card_plan_items": figs["card_plan_gib"].get("items_gib"),
    }
    return figs
