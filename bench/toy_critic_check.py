"""How well and how cheaply the toy critic scores what matters (issue 24, goal 3).

    python bench/toy_critic_check.py [--critic PATH] [--captions 48 --seeds 0,1] [--scenes 96] [--frames 0,1,2]

Three measurements, one process, one thread, JSON on stdout:

* **Reads the caption** (renders of ``--scenes`` held-out scenes, one frame each at a random time, through the patch
  latent model's round trip — the pictures the pipeline decodes): the critic's score with the right caption minus
  its score with the caption changed in one attribute (shape, colour, background, direction), paired by scene, with
  a bootstrap interval and the fraction of scenes where the right caption scores higher (0.5 = the attribute is
  not read). A per-frame critic cannot see direction: the direction row is its chance level.
* **Agrees with the judge** (draft-only rollouts of the tree's drafter on ``--captions`` held-out captions ×
  ``--seeds``): per block, the critic's worst frame (all frames, and each ``--frames`` subset size: the router's
  ``score_frames``) against the judge's accuracy on that block's frames; Spearman with a bootstrap interval over
  videos (the blocks of one video resampled together). The judge stays independent: it is never a label.
* **Costs** (same run): the median wall time of scoring one block (all frames, and each subset) against the median
  denoise time of a target block (blocks after the first of target-only rollouts of ``--cost-captions`` captions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install needed


def _r(values) -> list[float] | float | None:
    if values is None:
        return None
    return [round(v, 3) for v in values] if isinstance(values, (list, tuple)) else round(values, 3)


def block_slices(num_blocks: int) -> list[slice]:
    """Each block's pixel frames in the video (the first latent frame decodes to one frame, every other to four)."""
    from sdvg.blocks import pixel_frames_for_blocks

    ends = [pixel_frames_for_blocks(k + 1) for k in range(num_blocks)]
    return [slice(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def caption_reading(critic, vae, scenes: int, seed: int) -> dict:
    """Right-minus-wrong caption scores on round-tripped render frames, per changed attribute."""
    from sdvg.eval.stats import mean_ci
    from sdvg.toy.world import (
        BACKGROUNDS,
        DIRECTIONS,
        OBJECT_COLOURS,
        SHAPES,
        caption_of,
        is_held_out,
        render,
        sample_scene,
    )

    options = {"shape": SHAPES, "colour": list(OBJECT_COLOURS), "background": list(BACKGROUNDS),
               "direction": list(DIRECTIONS)}
    gen = torch.Generator().manual_seed(seed)
    diffs: dict[str, list[float]] = {a: [] for a in options}
    while len(diffs["shape"]) < scenes:
        scene = sample_scene(gen)
        if not is_held_out(scene.caption):
            continue
        frame = render(scene, 1, start=int(torch.randint(33, (), generator=gen)))
        vae.reset()
        frame = vae.decode_block(vae.encode_frame(frame))[:1]
        vae.reset()
        attrs = scene.attributes()
        right = float(critic.score(frame, scene.caption).min())
        for name, values in options.items():  # one wrong caption per attribute: the first other value
            wrong = caption_of(**{**attrs, name: next(v for v in values if v != attrs[name])})
            diffs[name].append(right - float(critic.score(frame, wrong).min()))
    out = {}
    for name, d in diffs.items():
        out[name] = {"right_minus_wrong": _r(list(mean_ci(d))), "right_higher": _r(sum(x > 0 for x in d) / len(d)),
                     "n": len(d)}
    return out


def rollouts(models, captions: list[str], seeds: list[int], mode: str) -> list[dict]:
    from sdvg.sampling.router import RouterConfig
    from sdvg.sampling.sampler import SpeculativeSampler
    from sdvg.toy.sheet import toy_sampler_config

    out = []
    for seed in seeds:
        cfg = toy_sampler_config(seed=seed)
        for c in captions:
            res = SpeculativeSampler(models, RouterConfig(mode=mode), cfg).run(c)
            out.append({"caption": c, "seed": seed, "frames": res.frames.float(), "blocks": res.blocks})
    return out


def judge_agreement(critic, videos: list[dict], subsets: list[int]) -> tuple[dict, dict[str, list[float]]]:
    """Spearman(critic's worst frame, judge accuracy) per block, for every frames subset; and the scoring times."""
    from sdvg.eval.stats import bootstrap_ci, spearman
    from sdvg.sampling.routing import spread_frames
    from sdvg.toy.judge import judge

    keys = ["all"] + [str(k) for k in subsets]
    per_video, times = [], {k: [] for k in keys}
    for v in videos:
        rows = []
        prompt = critic.prepare_prompt(v["caption"])
        for sl in block_slices(len(v["blocks"])):
            frames = v["frames"][sl]
            row = {"judge": judge(frames, v["caption"]).accuracy}
            for k in keys:
                idx = list(range(frames.shape[0])) if k == "all" else spread_frames(frames.shape[0], int(k))
                t = time.perf_counter()
                row[k] = float(critic.score(frames[idx], prompt).min())
                times[k].append(time.perf_counter() - t)
            rows.append(row)
        per_video.append(rows)

    def rho(group, key):
        flat = [r for rows in group for r in rows]
        return spearman([r[key] for r in flat], [r["judge"] for r in flat])

    flat = [r for rows in per_video for r in rows]
    out = {"blocks": len(flat), "videos": len(per_video),
           "judge_mean": _r(statistics.mean(r["judge"] for r in flat))}
    for k in keys:
        ci = bootstrap_ci(per_video, lambda g, key=k: rho(g, key))
        out[f"spearman_{k}"] = {"rho": _r(rho(per_video, k)), "ci": _r(list(ci)) if ci else None}
    return out, times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="toy models tree (default: the committed one)")
    p.add_argument("--critic", default=None, help="an ImageReward-format critic file replacing the tree's")
    p.add_argument("--target", default=None, help="a target file replacing the tree's (the cost's reference)")
    p.add_argument("--captions", type=int, default=48, help="held-out captions for the drafter rollouts")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--scenes", type=int, default=96, help="held-out scenes for the caption-reading check")
    p.add_argument("--frames", default="1,2,4", help="score_frames subset sizes to measure besides all frames")
    p.add_argument("--cost-captions", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from sdvg.loaders import load_models
    from sdvg.toy import TOY_DIR
    from sdvg.toy.world import held_out_captions

    files = {k: v for k, v in (("reward", a.critic), ("target", a.target)) if v}
    models = load_models(a.models or TOY_DIR, dit_device="cpu", aux_device="cpu", dtype="fp32", **files)
    critic = models.reward.eval()
    subsets = [int(k) for k in a.frames.split(",") if k]
    out: dict = {"critic": a.critic or "the tree's"}
    with torch.inference_mode():
        out["caption_reading"] = caption_reading(critic, models.vae, a.scenes, seed=4242)
        videos = rollouts(models, held_out_captions(a.captions), [int(s) for s in a.seeds.split(",")], "draft-only")
        out["judge_agreement"], times = judge_agreement(critic, videos, subsets)
        target = rollouts(models, held_out_captions(a.cost_captions), [0], "target-only")
    block = statistics.median(b.timings.get("target", 0.0) + b.timings.get("cache", 0.0)
                              for v in target for b in v["blocks"][1:])
    out["cost"] = {"target_block_s": _r(block)}
    for k, ts in times.items():
        med = statistics.median(ts)
        out["cost"][f"score_{k}"] = {"block_s": round(med, 4), "of_target_block": _r(med / block)}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
