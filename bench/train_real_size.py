"""A few Diagonal Distillation training steps at the real Self-Forcing 1.3B shapes with random weights (GPU check):
student, teacher and fake score all 1.3B, 832×480 (latents 60×104), 7 blocks = 21 latent frames, batch 1, bf16
autocast, gradient checkpointing, random text embeddings (4 × 512 × 4096: no text encoder). Writes the measured
seconds per iteration and peak memory beside the FSDP plan's one-GPU estimate.

    python bench/train_real_size.py --out out/gpu_check/train_real_size.json            # CUDA
    python bench/train_real_size.py --shape tiny --device cpu --out /tmp/t.json         # the same path, tiny shapes

Weights are random and the losses mean nothing; this measures that the real-size path runs, its speed and memory.
The JSON is rewritten after every iteration (``"partial": true`` until the run ends), so a killed run keeps the
iterations it timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _write_inputs(work: Path, shape: str) -> tuple[Path, Path, dict]:
    import torch

    from sdvg.fixtures.tiny import random_original_state_dict, write_krea_safetensors
    from sdvg.loaders.wan_keys import make_config
    from sdvg.train.plan import WAN_1P3B

    config = WAN_1P3B if shape == "real" else make_config(2, 32, 16, 16, 64, 64, 128, 2, (1, 2, 2))
    dit = write_krea_safetensors(work / "dit.safetensors", random_original_state_dict(config, seed=0),
                                 config["num_attention_heads"])
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(4, 512, config["text_dim"], generator=gen).to(torch.bfloat16) * 0.1
    torch.save({"prompts": [f"p{i}" for i in range(4)], "embeds": embeds, "negative": embeds[:1] * 0},
               str(work / "embeds.pt"))
    return dit, work / "embeds.pt", config


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=["real", "tiny"], default="real")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    import torch

    from sdvg.train import load_config, train_diagonal
    from sdvg.train.loop import peak_memory_mb
    from sdvg.train.plan import format_plan, memory_plan

    real = args.shape == "real"
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sdvg-train-real-") as tmp:
        work = Path(tmp)
        dit, embeds, config = _write_inputs(work, args.shape)
        plan = memory_plan(config=config, gpus=1, num_frames=(7 if real else 2) * 3,
                           latent_hw=(60, 104) if real else (8, 8))
        head = {"shape": args.shape, "device": args.device, "plan_total_gib_1gpu": plan["total"] / 2**30,
                "plan": {k: v for k, v in plan.items() if isinstance(v, int | float | str)}}
        iters: list[dict] = []

        def progress(p: dict) -> None:
            iters.append(p)
            peak = peak_memory_mb(torch.device(args.device))
            _write(out_path, {**head, "partial": True, "steps": p["step"], "s_per_iter": p["s_per_iter"],
                              "peak_memory_mb": peak, "iterations": iters})

        _write(out_path, {**head, "partial": True, "steps": 0})
        cfg = load_config(None, teacher=str(dit), student_init=str(dit), data=str(embeds), out=str(work / "run"),
                          steps=args.steps, batch=1, latent_hw=(60, 104) if real else (8, 8),
                          num_blocks=7 if real else 2, regression_weight=0.0, gen_every=2, save_every=10**6,
                          device=args.device, gradient_checkpointing=True, motion_hidden=64)
        res = train_diagonal(cfg, progress=progress)
    _write(out_path, {**head, "partial": False, "steps": res.steps, "s_per_iter": res.s_per_iter,
                      "peak_memory_mb": res.peak_memory_mb, "losses": res.losses, "iterations": iters})
    sys.stdout.write(format_plan([plan]) + f"\nmeasured: {res.s_per_iter:.2f} s/iter, peak {res.peak_memory_mb:.0f} "
                     f"MiB ({args.device})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
