"""Peak RSS and per-block time of long videos on the tiny models, through the real CLI (``generate --out``, which
streams the mp4 block by block). Every length runs in a fresh process, so each peak RSS is that run's own.

    python bench/long_video.py --blocks 7,28,112 --cache recompute,noisy

Prints one row per (cache, blocks): peak RSS of the process (MiB), the run's wall time per block (ms; the report's
``wall_s``, model loading excluded), and the same for a run that keeps the whole video in RAM (``--save-frames``,
the pre-streaming behaviour) when ``--compare-kept`` is given.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one(blocks: int, cache: str, size: int, keep: bool, mode: str) -> dict:
    """Runs in the child: one generate, then its own peak RSS."""
    sys.path.insert(0, str(REPO))
    from sdvg.cli.commands import main

    out = Path(tempfile.mkdtemp(prefix="sdvg-long-"))
    argv = ["generate", "--prompt", "a fox in snow", "--blocks", str(blocks), "--cache", cache, "--width", str(size),
            "--height", str(size), "--mode", mode, "--out", str(out / "v.mp4"), "--threads", "1",
            "--report", str(out / "r.json")]
    if cache == "noisy":
        argv += ["--positions", "window"]
    if keep:
        argv += ["--save-frames", str(out / "f.safetensors")]
    code = main(argv)
    wall = json.loads((out / "r.json").read_text())["totals"]["wall_s"]  # the run itself, not the model loads
    return {"code": code, "wall_s": wall, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="7,28,112")
    p.add_argument("--cache", default="recompute,noisy")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--mode", default="reward")
    p.add_argument("--compare-kept", action="store_true", help="also run with --save-frames (whole video in RAM)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        blocks, cache, keep = args.child.split(":")
        sys.stdout.write(json.dumps(one(int(blocks), cache, args.size, keep == "1", args.mode)) + "\n")
        return
    sys.stdout.write(f"{'cache':10s} {'blocks':>6s} {'peak RSS MiB':>13s} {'ms/block':>9s}"
                     f"{'   kept: RSS MiB  ms/block' if args.compare_kept else ''}\n")
    for cache in args.cache.split(","):
        for blocks in (int(b) for b in args.blocks.split(",")):
            row = []
            for keep in ([False, True] if args.compare_kept else [False]):
                child = [sys.executable, __file__, "--size", str(args.size), "--mode", args.mode,
                         "--child", f"{blocks}:{cache}:{int(keep)}"]
                proc = subprocess.run(child, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"the {cache}/{blocks}-block run failed:\n{proc.stderr[-2000:]}")
                res = json.loads(proc.stdout.splitlines()[-1])
                if res["code"] != 0:
                    raise SystemExit(f"generate exited {res['code']} ({cache}, {blocks} blocks)")
                row.append(f"{res['peak_rss_mib']:13.1f} {1000 * res['wall_s'] / blocks:9.1f}")
            sys.stdout.write(f"{cache:10s} {blocks:6d} " + "   ".join(row) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
