"""The one-shot GPU check (``bench/gpu_check.sh``): its steps, their time budgets, the ``$OUT`` layout, summary.json.

The GPU machine gives one command of at most 10 minutes, no network, and sends back at most 8 files under ``$OUT``
(16 MiB each, at most two folders down). So:

- every step runs as its own process under its own budget (:data:`STEPS`; the GPU budgets add up to
  :data:`BUDGET_TOTAL_S` ≤ :data:`LIMIT_S` = 540 s, and so do the CPU-smoke budgets, which give the tiny CPU
  correctness checks more time and the real-size steps, tiny there, less), each step is attempted even when an earlier one failed or timed
  out, and a step is never started past the overall deadline;
- the step scripts rewrite their JSON as they measure (``PYTHONUNBUFFERED=1``, partial JSON), and summary.json and the
  log archive are rewritten after every step, so a killed step or a killed check keeps what was measured;
- ``$OUT`` holds only :data:`OUT_FILES` (summary.json, logs.tar.gz and the steps' named results); logs, the tiny-model
  cache and scratch files live in a work folder outside it, and anything else found under ``$OUT`` at the end is
  moved into the archive.

``--cpu-smoke`` runs the same steps at tiny shapes on the CPU (what CI and reviewers run). The figures summary.json
collects are described in :mod:`sdvg.bench.gpu_summary` and docs/PERFORMANCE.md.

    python -m sdvg.bench.gpu_check --out OUT [--cpu-smoke] [--wheels .whl] [--work DIR] [--only STEP,...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .gpu_summary import collect_figures, describe_checks

SCHEMA = "sdvg-gpu-check/1"
LIMIT_S = 540  # one device command is capped at 600 s; keep a minute for the machine's start-up and the transfers
OUT_MAX_FILES = 8
OUT_MAX_DEPTH = 2  # $OUT/a/b/file comes back, $OUT/a/b/c/file does not
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Step:
    """One step: ``gpu`` / ``cpu`` are argv tails after the Python executable, with ``{out}`` and ``{work}``;
    ``budget_s`` / ``cpu_budget_s`` the seconds it may take on the GPU machine / in the CPU smoke."""

    name: str
    budget_s: int
    cpu_budget_s: int
    gpu: tuple[str, ...]
    cpu: tuple[str, ...]
    outputs: tuple[str, ...] = ()  # files it writes under $OUT

    def budget(self, cpu_smoke: bool) -> int:
        return self.cpu_budget_s if cpu_smoke else self.budget_s

    def argv(self, python: str, cpu_smoke: bool, out: Path, work: Path) -> list[str]:
        tail = self.cpu if cpu_smoke else self.gpu
        return [python, *(a.format(out=out, work=work) for a in tail)]


_BENCH_ROWS = ("--only", "scored,pipelined", "--json", "{out}/real_size.json", "--plot", "{out}/real_size.png")
STEPS: tuple[Step, ...] = (
    # diffusers from the carried wheels when the image lacks it (run in-process: see _install_wheels)
    Step("deps", 30, 30, (), ()),
    Step("cuda_smoke", 70, 135, ("bench/cuda_smoke.py", "--out", "{out}/cuda_smoke.json"),
         ("bench/cuda_smoke.py", "--device", "cpu", "--out", "{out}/cuda_smoke.json"), ("cuda_smoke.json",)),
    # the 24 GiB card plan's line items (built on the meta device: the same on both)
    Step("plan", 25, 40, ("-m", "sdvg", "bench", "--profile", "real-size", "--dry-run", "--json", "{work}/plan.json"),
         ("-m", "sdvg", "bench", "--profile", "real-size", "--dry-run", "--json", "{work}/plan.json")),
    Step("real_size", 180, 140, ("-m", "sdvg", "bench", "--profile", "real-size", *_BENCH_ROWS),
         ("-m", "sdvg", "bench", "--profile", "tiny", "--blocks", "3", "--repeats", "1", "--warmup", "0",
          "--levels", "0,50,100", *_BENCH_ROWS), ("real_size.json", "real_size.png")),
    Step("offload", 90, 90, ("bench/offload_lora_check.py", "--real", "--resident", "9", "--out", "{out}/offload.json"),
         ("bench/offload_lora_check.py", "--device", "cpu", "--real", "--real-shape", "tiny", "--resident", "1",
          "--out", "{out}/offload.json"), ("offload.json",)),
    Step("train", 125, 75, ("bench/train_real_size.py", "--steps", "3", "--out", "{out}/train.json"),
         ("bench/train_real_size.py", "--shape", "tiny", "--device", "cpu", "--steps", "2",
          "--out", "{out}/train.json"), ("train.json",)),
    # GGUF / scaled-fp8 DiTs: the torch dequant kernels on the device vs gguf's numpy, quantized vs dequantized twin
    Step("quant", 20, 30, ("bench/quant_check.py", "--device", "cuda", "--dtype", "bf16", "--repeats", "5",
                           "--out", "{out}/quant.json"),
         ("bench/quant_check.py", "--device", "cpu", "--repeats", "3", "--out", "{out}/quant.json"), ("quant.json",)),
)
BUDGET_TOTAL_S = sum(s.budget_s for s in STEPS)
CPU_BUDGET_TOTAL_S = sum(s.cpu_budget_s for s in STEPS)
OUT_FILES = ("summary.json", "logs.tar.gz", *(f for s in STEPS for f in s.outputs))


def check_plan(steps: tuple[Step, ...] = STEPS) -> list[str]:
    """Problems with a step table: budgets over the limit, more result files than come back, duplicate names."""
    problems = []
    for label, total in (("GPU", sum(s.budget_s for s in steps)), ("CPU-smoke", sum(s.cpu_budget_s for s in steps))):
        if total > LIMIT_S:
            problems.append(f"{label} step budgets add up to {total} s > {LIMIT_S} s")
    files = ["summary.json", "logs.tar.gz", *(f for s in steps for f in s.outputs)]
    if len(files) > OUT_MAX_FILES:
        problems.append(f"{len(files)} result files > {OUT_MAX_FILES}")
    if len(set(files)) != len(files) or len({s.name for s in steps}) != len(steps):
        problems.append("duplicate step or file names")
    return problems


def out_layout(out: Path) -> dict:
    """What is under ``out``: files (relative), how many, the deepest folder level, and whether it all comes back."""
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() or p.is_symlink())
    depth = max((f.count("/") for f in files), default=0)
    return {"files": files, "count": len(files), "max_depth": depth,
            "ok": len(files) <= OUT_MAX_FILES and depth <= OUT_MAX_DEPTH}


class Check:
    """One run of the check: runs the steps, keeps summary.json and logs.tar.gz current after each."""

    def __init__(self, out: Path, work: Path, cpu_smoke: bool, wheels: Path | None, python: str = sys.executable):
        self.out, self.work, self.cpu_smoke, self.wheels, self.python = out, work, cpu_smoke, wheels, python
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8",
                        SDVG_CACHE_DIR=os.environ.get("SDVG_CACHE_DIR") or str(work / "sdvg-cache"))
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        if cpu_smoke:
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.summary: dict = {
            "schema": SCHEMA, "mode": "cpu-smoke" if cpu_smoke else "gpu", "finished": False,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "limit_s": LIMIT_S,
            "budget_total_s": CPU_BUDGET_TOTAL_S if cpu_smoke else BUDGET_TOTAL_S,
            "budgets_s": {s.name: s.budget(cpu_smoke) for s in STEPS},
            "steps": {}, "env": {}, "figures": {}, "checks_compare": describe_checks(),
        }

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def save(self) -> None:
        """summary.json (figures from whatever the steps wrote so far) and logs.tar.gz, both atomically."""
        self.summary["elapsed_s"] = round(self.elapsed(), 1)
        self.summary["figures"] = collect_figures(self.out, self.work, self.cpu_smoke)
        self.summary["out_layout"] = out_layout(self.out)
        _write_json(self.out / "summary.json", self.summary)
        tmp = self.work / "logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for p in sorted(self.work.iterdir()):
                if p.name not in ("sdvg-cache", tmp.name, "site"):
                    tar.add(p, arcname=p.name)
        os.replace(tmp, self.out / "logs.tar.gz")

    def record(self, name: str, **fields) -> None:
        self.summary["steps"].setdefault(name, {}).update(fields)
        self.save()

    # -- steps -------------------------------------------------------------------------------------------------
    def run(self, only: set[str] | None = None, steps: tuple[Step, ...] = STEPS) -> bool:
        self.summary["env"] = self._probe_env()
        self.save()
        for step in steps:
            if only and step.name not in only and step.name != "deps":
                self.record(step.name, status="skipped", error="not in --only")
                continue
            self._step(step)
        self.summary["env"] = self._probe_env()  # again: after deps it can name the diffusers in use
        self._tidy_out(("summary.json", "logs.tar.gz", *(f for s in steps for f in s.outputs)))
        self.summary["finished"] = True
        self.save()
        return all(s.get("status") in ("ok", "skipped") for s in self.summary["steps"].values())

    def _step(self, step: Step) -> None:
        left = LIMIT_S - self.elapsed() - 5
        if left < 5:
            self.record(step.name, status="skipped", budget_s=step.budget(self.cpu_smoke),
                        error="no time left before the deadline")
            return
        budget = step.budget(self.cpu_smoke)
        timeout = min(budget, left)
        self.record(step.name, status="running", budget_s=budget, timeout_s=round(timeout, 1))
        start = time.monotonic()
        try:
            if step.name == "deps":
                fields = self._install_wheels(timeout)
            else:
                fields = self._subprocess(step, timeout)
        except Exception as exc:  # noqa: BLE001 - a step's failure is recorded and the next step still runs
            fields = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        self.record(step.name, seconds=round(time.monotonic() - start, 2), **fields)

    def _subprocess(self, step: Step, timeout: float) -> dict:
        argv = step.argv(self.python, self.cpu_smoke, self.out, self.work)
        log = self.logs / f"{step.name}.log"
        with open(log, "w", encoding="utf-8") as fh:
            fh.write("$ " + " ".join(argv) + "\n")
            fh.flush()
            proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return {"status": "timeout", "rc": None, "log": f"logs/{log.name}",
                        "error": f"killed after its {timeout:.0f} s budget; " + _tail(log)}
        fields = {"rc": rc, "log": f"logs/{log.name}", "status": "ok" if rc == 0 else "failed"}
        if rc != 0:
            fields["error"] = _tail(log)
        return fields

    def _install_wheels(self, timeout: float) -> dict:
        """diffusers (and gguf) from ``self.wheels`` (``pip install --no-index --no-deps --target``) when it does not import."""
        probe = [self.python, "-c", "import diffusers, gguf; print(diffusers.__version__)"]  # gguf: the quant step
        got = subprocess.run(probe, env=self.env, capture_output=True, text=True, timeout=timeout)
        if got.returncode == 0:
            return {"status": "ok", "diffusers": got.stdout.strip(), "from": "the image"}
        wheels = sorted(self.wheels.glob("*.whl")) if self.wheels and self.wheels.is_dir() else []
        if not wheels:
            return {"status": "failed", "error": f"diffusers does not import and no wheels in {self.wheels}: run "
                    "bench/gpu_prepare.sh here and carry .whl"}
        site = self.work / "site"
        cmd = [self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, wheels)]
        inst = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if inst.returncode != 0:
            return {"status": "failed", "error": "pip install from wheels failed: " + inst.stderr[-1500:]}
        self.env["PYTHONPATH"] = os.pathsep.join((str(site), self.env["PYTHONPATH"]))
        got = subprocess.run(probe, env=self.env, capture_output=True, text=True, timeout=timeout)
        if got.returncode != 0:
            return {"status": "failed", "error": "diffusers installed but does not import: " + got.stderr[-1500:]}
        return {"status": "ok", "diffusers": got.stdout.strip(), "from": f"wheels ({', '.join(w.name for w in wheels)})"}

    def _probe_env(self) -> dict:
        code = ("import json, platform, sys, torch\n"
                "d = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
                "     'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,\n"
                "     'gpu_memory_gib': (torch.cuda.get_device_properties(0).total_memory / 2**30\n"
                "                        if torch.cuda.is_available() else None)}\n"
                "for m in ('transformers', 'diffusers', 'safetensors', 'huggingface_hub', 'numpy', 'av'):\n"
                "    try:\n"
                "        d[m] = __import__(m).__version__\n"
                "    except Exception as exc:\n"
                "        d[m] = None\n"
                "print(json.dumps(d))\n")
        try:
            got = subprocess.run([self.python, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
            return json.loads(got.stdout) if got.returncode == 0 else {"error": got.stderr[-800:]}
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            return {"error": repr(exc)}

    def _tidy_out(self, keep: tuple[str, ...] = OUT_FILES) -> None:
        """Move anything under $OUT that is not a named result (a stray temp file) into the work folder."""
        stray = self.work / "stray"
        for p in list(self.out.rglob("*")):
            rel = str(p.relative_to(self.out))
            if p.is_file() and rel not in keep:
                stray.mkdir(exist_ok=True)
                os.replace(p, stray / rel.replace("/", "_"))


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, chars: int = 1500) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    return text[-chars:]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str, allow_nan=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-smoke", action="store_true", help="the same steps at tiny shapes on the CPU")
    ap.add_argument("--wheels", type=Path, default=REPO / ".whl", help="wheels to install when diffusers is missing")
    ap.add_argument("--work", type=Path, default=None, help="logs and caches (default: a new folder under the temp "
                    "dir; never under --out)")
    ap.add_argument("--only", default="", help="comma list of steps to run (the others are recorded as skipped)")
    args = ap.parse_args(argv)
    problems = check_plan()
    if problems:
        sys.stderr.write("gpu_check: " + "; ".join(problems) + "\n")
        return 2
    out = args.out.resolve()
    work = (args.work or Path(tempfile.mkdtemp(prefix="sdvg-gpu-check-"))).resolve()
    if work == out or out in work.parents:
        sys.stderr.write(f"gpu_check: --work {work} must be outside --out {out} (only results come back)\n")
        return 2
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    unknown = (only or set()) - {s.name for s in STEPS}
    if unknown:
        sys.stderr.write(f"gpu_check: unknown step(s) {', '.join(sorted(unknown))}; steps: "
                         f"{', '.join(s.name for s in STEPS)}\n")
        return 2
    check = Check(out, work, args.cpu_smoke, args.wheels)
    ok = check.run(only)
    for name, st in check.summary["steps"].items():
        sys.stderr.write(f"{name:11s} {st.get('status', '?'):8s} {st.get('seconds', 0):7.1f} s "
                         f"(budget {st.get('budget_s', '-')} s)\n")
    sys.stderr.write(f"gpu_check: {'all steps ok' if ok else 'some steps failed'}, "
                     f"{check.summary['elapsed_s']} s; results in {out}, logs in {out / 'logs.tar.gz'}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
