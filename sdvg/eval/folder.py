"""The evaluation's output folder: its file names, the writable check, the settings a resume must match
(``eval_settings.json``) and the append-only ``results.csv`` that makes an interrupted evaluation lose at most one row."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..loaders.file_checks import broken_link
from .summary import METRIC_PREFIX
from .summary import cell as _cell

logger = logging.getLogger(__name__)

RESULTS = "results.csv"
SUMMARY = "summary.csv"
PARETO = "pareto.png"
SETTINGS = "eval_settings.json"
BASE_COLUMNS = (
    "prompt_id", "method", "tau", "prompt", "seed", "blocks", "wall_s", "speedup", "acceptance", "accepted",
    "drafted", "pattern", "ir_mean", "ir_min", "ir_retention", "ir_delta", "router_seed", "video", "real_tmacs",
    "speedup_real",
)
def check_out_dir(out_dir: str | Path) -> Path:
    """The eval output folder, created if needed and checked writable (call it before any model loads)."""
    out = Path(out_dir)
    problem = broken_link(out) or (f"{out} is a file, not a folder." if out.exists() and not out.is_dir() else None)
    try:
        problem = problem or out.mkdir(parents=True, exist_ok=True)  # None: made, or there
    except OSError as exc:
        problem = f"cannot create the folder {out} ({exc.strerror or exc})."
    problem = problem or (None if os.access(out, os.W_OK | os.X_OK) else f"the folder {out} is not writable.")
    if problem:
        raise ConfigError(f"--out: {problem} eval writes {RESULTS}, {SUMMARY}, {PARETO} and videos/ into a folder: "
                          "pass a new or existing folder you can write to (e.g. --out eval-runs/first).")
    return out


def run_settings(config, score_frames: int = 0, rate_router: Mapping[str, float] | None = None,
                 models: Mapping[str, Any] | None = None) -> dict:
    """What decides a row's numbers besides its prompt, method and τ: the sampler config, the reward rows' scored
    frames, the target-rate router's prior and (when the caller knows it) where the models came from — as JSON."""
    settings = {"sampler": dataclasses.asdict(config), "score_frames": int(score_frames),
                "rate_router": dict(rate_router or {}), "models": dict(models or {})}
    return json.loads(json.dumps(settings, default=str, sort_keys=True))


def check_run_settings(out: Path, settings: dict, *, write: bool = True) -> None:
    """Refuse to resume ``out`` with other settings than its rows were made with (``eval_settings.json``, written
    by the first run): rows with, say, a different ``score_frames`` would be mixed into one summary. A folder
    without the file (new, or from before it existed) takes the run's settings; the models are compared only when
    both runs recorded them (the CLI does). ``write=False`` checks only (the CLI, before loading the models)."""
    path = out / SETTINGS
    if not path.is_file():
        if write:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            tmp.replace(path)
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--out: {path} is unreadable ({exc}); it records the settings of the rows in {out}. "
                          "Pass a new --out, or delete the file to let this run's settings stand for them.") from exc
    if not (old.get("models") and settings.get("models")):  # an API caller that did not say: models not compared
        old, settings = {**old, "models": {}}, {**settings, "models": {}}
    changed = _changed(old, settings)
    if changed:
        raise ConfigError(f"--out {out} holds rows made with other settings ({'; '.join(changed[:6])}). Rerun with "
                          f"the settings in {path} to continue it, or pass a new --out.")


def _changed(old: Any, new: Any, key: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for k in sorted(set(old) | set(new))
                for c in _changed(old.get(k), new.get(k), f"{key}.{k}" if key else k)]
    return [] if old == new else [f"{key}: {old!r} there, {new!r} now"]


def tau_key(tau: float | None) -> str:
    return "" if tau is None else f"{tau:g}"


# ----------------------------------------------------------------------------------------------------------
# results file


class ResultsFile:
    """Append-only CSV with one row per finished (prompt, method, τ); survives interruption at any point."""

    def __init__(self, path: Path, metric_names: Sequence[str] | None):
        self.path = path
        self.rows: list[dict[str, str]] = []
        self.columns: list[str] | None = None
        self.metric_names = list(metric_names) if metric_names is not None else None
        if path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # killed mid-write: drop the partial last line
            cut = data.rfind(b"\n") + 1
            with self.path.open("r+b") as fh:
                fh.truncate(cut)
            logger.warning("dropped an incomplete last line of %s", self.path)
        with self.path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            self.columns = list(reader.fieldnames or [])
            self.rows = [r for r in reader if r.get("prompt_id") not in (None, "")]
        if self.columns and self.columns[: len(BASE_COLUMNS)] != list(BASE_COLUMNS):
            raise ConfigError(f"{self.path} was not written by this version of `sdvg eval`; use another --out.")

    def key(self, row: Mapping[str, Any]) -> tuple[str, str, str]:
        return str(row["prompt_id"]), str(row["method"]), str(row["tau"])

    def done(self) -> set[tuple[str, str, str]]:
        return {self.key(r) for r in self.rows}

    def find(self, prompt_id: int, method: str, tau: float | None) -> dict[str, str] | None:
        return next((r for r in self.rows if self.key(r) == (str(prompt_id), method, tau_key(tau))), None)

    def append(self, row: dict[str, Any]) -> None:
        metrics = sorted(k for k in row if k.startswith(METRIC_PREFIX))
        new = self.columns is None or not self.path.exists() or self.path.stat().st_size == 0
        if self.columns is None:
            names = [METRIC_PREFIX + n for n in self.metric_names] if self.metric_names is not None else metrics
            self.columns = [*BASE_COLUMNS, *names]
        extra = [m for m in metrics if m not in self.columns]
        if extra:
            raise ConfigError(
                f"Metric column(s) {extra} are not in {self.path} (written with {self.columns[len(BASE_COLUMNS):]}). "
                "Use the same --metric list as the first run, or a new --out."
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, lineterminator="\n", extrasaction="raise")
            if new:
                writer.writeheader()
            writer.writerow({c: _cell(row.get(c)) for c in self.columns})
            fh.flush()
            os.fsync(fh.fileno())
        self.rows.append({c: _cell(row.get(c)) for c in self.columns})
