"""The toy distillation recipe after Self-Forcing / CausVid, one resumable command (CPU, long: run it in the
background):

    nohup nice -n 10 env OMP_NUM_THREADS=1 python bench/distill_recipe.py --out out/recipe > out/recipe.log 2>&1 &

1. **ODE initialisation** (``out/ode``): the student starts as the teacher (the toy target, as Self-Forcing distils
   Wan into itself) and is regressed onto the teacher's videos from ``--pairs`` cached teacher ODE pairs (made once,
   ``ode/ode_pairs.pt``), from the teacher's path state at each block's exit timestep of the student's own diagonal
   schedule (``dmd_weight`` 0: no rollout, no scores). Trained in chunks of ``--chunk`` iterations until the student,
   sampled with **fresh noise** on its own schedule, reaches ``--target-ratio`` × the teacher's judge on the quick
   held-out check, or ``--ode-steps``.
2. **DMD** (``out/dmd``): from the ODE-initialised student, DMD with diagonal forcing (noisy cache) and the flow
   term, ``gen_every`` fake-score updates per generator update (Self-Forcing's 5), each model's learning rate its own
   key, the teacher regression kept at ``--dmd-regression``.

After every chunk the EMA student is sampled as the SDVG drafter (draft-only, its diagonal schedule, fresh noise, noisy
cache) on held-out (caption, seed) pairs (every toy caption × sampling seed 9000: never a training noise) and judged;
the rows go to ``eval.jsonl``. Rerun the same command to resume (state in each stage's ``state.pt``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

QUICK_SEEDS = [9000]  # held out: the training noise comes from the run's own generators, never a sampler seed
#: --captions: (what training reads, what the checks judge). "heldout": the world's 144 training captions, judged on
#: its 72 held-out ones (the protocol for a teacher trained on the training captions). "v1": the first world's 72
#: captions for both, held out by seed only — the protocol of the first-world toy target, which was trained on all of
#: them and knows no other colour or background.
CAPTION_SETS = {"heldout": ("train_captions", "held_out_captions"), "v1": ("v1_captions", "v1_captions")}
_captions = {"set": "heldout"}


def captions(role: str) -> list[str]:
    """The training (``role`` "train") or the judged ("eval") captions of the run's ``--captions`` set."""
    from sdvg.toy import world

    train, judged = CAPTION_SETS[_captions["set"]]
    return getattr(world, train if role == "train" else judged)()


def prompts_file(out: Path) -> Path:
    """The training captions as a prompt file (``data``): the trainer's "toy" bank is the current world's."""
    path = out / f"prompts_{_captions['set']}.txt"
    path.write_text("\n".join(captions("train")) + "\n", encoding="utf-8")
    return path


def ode_config(args) -> dict:
    from sdvg.toy.preset import toy_files

    return {"student_init": str(args.ode_init or toy_files()["target"]), "data": str(prompts_file(Path(args.out))),
            "text_encoder": str(toy_files()["text_encoder"]), "dmd_weight": 0.0, "flow_weight": 0.0,
            "regression_weight": 1.0, "ode_pairs": args.pairs, "batch": args.batch, "lr": args.ode_lr,
            "betas": [0.9, 0.999], "warmup": 50, "ema": 0.99, "save_every": args.chunk, "seed": 0}


#: --variant: goal 3's ablations of the DMD stage (diagonal_study's variants, the regression-only one aside)
ABLATIONS = ("diagonal", "no-flow", "clean-cache", "constant")


def variant_sampling(variant: str) -> dict:
    """How a ``variant``'s student samples as it was trained (:class:`sdvg.train.measure.Sampling` keywords): the
    cache and schedule its config trains with (the two share their names)."""
    from diagonal_study import VARIANTS

    changes = VARIANTS.get(variant, {})  # another name (an undistilled or --extra row) samples as the recipe
    return {k: changes[k] for k in ("cache", "schedule") if k in changes}


def stage_name(base: str, variant: str) -> str:
    """The stage folder of ``variant``'s run: the recipe's own name, suffixed for an ablation."""
    return base if variant == "diagonal" else f"{base}-{variant}"


def dmd_config(args, student: Path) -> dict:
    from diagonal_study import VARIANTS

    from sdvg.toy.preset import toy_files

    return {"student_init": str(student), "data": str(prompts_file(Path(args.out))),
            "text_encoder": str(toy_files()["text_encoder"]), "dmd_weight": 1.0, "flow_weight": 0.2,
            "regression_weight": args.dmd_regression, "ode_pairs": args.pairs, "batch": args.batch,
            "lr": args.dmd_lr, "lr_fake": args.fake_lr, "gen_every": 5, "betas": [0.0, 0.999], "warmup": 20,
            "ema": 0.99, "save_every": args.chunk, "seed": 0, **VARIANTS[getattr(args, "variant", "diagonal")]}


def evaluate(student: Path, seeds: list[int], caps: list[str] | None = None, variant: str = "diagonal") -> dict:
    """The quick check of ``student``: on its training cache (noisy; clean for the clean-cache ablation), and its
    judge on the recompute cache the eval and SDVG run a drafter with (``judge_recompute``, with its interval), each on
    the schedule it was trained on."""
    from diagonal_study import _models

    from sdvg.train.measure import Sampling, measure

    _models.cache_clear()
    caps = caps or captions("eval")
    how = variant_sampling(variant)
    row = measure(_models, Sampling("student", str(student), **how), caps, seeds)
    sdvg = measure(_models, Sampling("student", str(student), **{**how, "cache": "recompute"}), caps, seeds)
    return {**row, **{f"{k}_recompute": sdvg[k] for k in ("judge", "judge_lo", "judge_hi")}}


def teacher_row(out: Path, seeds: list[int]) -> dict:
    path = out / f"teacher_{_captions['set']}_{'_'.join(map(str, seeds))}_recompute.json"  # the sampler's cache
    if path.is_file():
        return json.loads(path.read_text())
    from diagonal_study import _models

    from sdvg.train.measure import Sampling, measure

    row = measure(_models, Sampling("teacher", None), captions("eval"), seeds)
    path.write_text(json.dumps(row) + "\n")
    return row


FINAL_SEEDS = [9001, 9002]  # held out from the quick check too (which picked nothing but was watched)


def final(out: Path, student: Path, seeds: list[int]) -> dict:
    """The student (on its training cache, and on the recompute cache the eval and SDVG run it with), the undistilled
    teacher weights on the student's schedule (on both caches: what distillation adds) and the teacher (10 ODE steps, recompute cache) on every toy caption ×
    ``seeds``, each with its agreement with the teacher's video from the same seed, and each student's judge as a
    fraction of the teacher's with a paired bootstrap interval (pairs resampled together)."""
    from diagonal_study import _models

    from sdvg.eval.stats import bootstrap_ci
    from sdvg.toy.preset import toy_files
    from sdvg.train.measure import Sampling, measure

    teacher = Sampling("teacher (toy target, 10 ODE steps)", None)
    students = [Sampling("student (diagonal 4-3-2, fresh noise, noisy cache as trained)", str(student)),
                Sampling("student (diagonal 4-3-2, fresh noise, recompute cache as SDVG runs it)", str(student),
                         cache="recompute"),
                Sampling("teacher weights on the student's schedule (undistilled), noisy cache", str(toy_files()["target"])),
                Sampling("teacher weights on the student's schedule (undistilled), recompute cache",
                         str(toy_files()["target"]), cache="recompute")]
    rows = [measure(_models, s, captions("eval"), seeds, reference=teacher) for s in students]
    rows.append(measure(_models, teacher, captions("eval"), seeds))
    t = rows[-1]["accuracies"]
    for row in rows[:-1]:
        pairs = list(zip(row["accuracies"], t, strict=True))
        ratio = lambda ps: sum(a for a, _ in ps) / max(1e-9, sum(b for _, b in ps))  # noqa: E731
        row["ratio"], (row["ratio_lo"], row["ratio_hi"]) = ratio(pairs), bootstrap_ci(pairs, ratio)
        row["speedup_per_video"] = rows[-1]["s_per_video"] / row["s_per_video"]
    res = {"student": str(student), "seeds": seeds, "captions": _captions["set"], "rows": rows, "fidelity_baselines": fidelity_baselines(seeds[0])}
    (out / "final.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def fidelity_baselines(seed: int) -> dict:
    """What the agreement measure gives a flat field (each teacher video's mean colour everywhere) and a correct
    teacher video from other noise, against the teacher's video from ``seed``, over every toy caption (means and 95 %
    intervals) — the separation latent MSE could not make (flat 0.196 < students 0.200-0.213 < teacher 0.305)."""
    from diagonal_study import _models

    from sdvg.eval.stats import mean_ci
    from sdvg.toy.judge import agreement, judge
    from sdvg.train.measure import Sampling, _video

    teacher, models = Sampling("teacher", None), _models(None)
    got: dict[str, list[float]] = {"flat": [], "other_noise": [], "flat_ungated": [], "teacher_ungated": []}
    for caption in captions("eval"):
        ref = _video(models, teacher, caption, seed, 3).frames
        flat = ref.float().mean(dim=(0, 1, 2), keepdim=True).expand_as(ref).to(ref.dtype)
        got["flat"].append(agreement(flat, ref, caption))
        got["other_noise"].append(agreement(_video(models, teacher, caption, seed + 1000, 3).frames, ref, caption))
        got["flat_ungated"].append(judge(flat, caption).ungated)
        got["teacher_ungated"].append(judge(ref, caption).ungated)
    return {k: list(mean_ci(v)) for k, v in got.items()}


def export(src: Path, dst: Path) -> Path:
    """The committed student: Self-Forcing's layout with the EMA weights only (``generator_ema``, what every loader
    takes first), in bf16 like the toy target, so it fits the 10 MB a committed file may take."""
    import torch

    from sdvg.loaders.checkpoint import torch_load

    pt = torch_load(src)
    ema = {k: v.to(torch.bfloat16).contiguous() for k, v in pt["generator_ema"].items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"generator_ema": ema, "config": pt["config"]}, str(dst))
    return dst


STUDENT_FILE = "diffusion_models/sdvg_toy_student.pt"
STUDENT_SAMPLING = {"schedule": "diagonal", "step_noise": "fresh"}  # as trained: diagonal 4→3→2, fresh noise


def install(src: Path, tree: Path, provenance: dict) -> Path:
    """Make ``src``'s EMA (bf16, :func:`export`) the drafter of the toy models ``tree``: the file, the stamp's
    ``files.drafter``, its ``drafter_sampling`` (the CLI's, the nodes' workflow's and the toy sampler's default for
    it) and a ``student`` entry with the command, seeds and steps that made it."""
    dst = export(src, tree / STUDENT_FILE)
    stamp_path = tree / "sdvg_toy.json"
    stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
    stamp["files"]["drafter"] = STUDENT_FILE
    stamp["drafter_sampling"] = dict(STUDENT_SAMPLING)
    stamp["student"] = provenance
    tmp = stamp_path.with_name("partial-" + stamp_path.name)
    tmp.write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
    tmp.replace(stamp_path)
    return dst


def plot(out: Path) -> Path:
    """``losses.png``: the ODE stage's regression, the DMD stage's generator (DMD) and fake-score losses, moving mean
    of 25, from each stage's ``train.json``."""
    from diagonal_study import _smooth, loss_axes

    from sdvg.outputs.plotting import Chart

    curves = [("ode", "regression", (44, 160, 44), "ODE init: regression"),
              ("dmd-from-teacher", "dmd", (214, 39, 40), "DMD: generator (DMD term)"),
              ("dmd-from-teacher", "fake", (31, 119, 180), "DMD: fake score (flow matching)")]
    chart = Chart(900, 420, (70, 40, 640, 370), title="Toy distillation recipe: losses per iteration (moving mean 25)")
    series = []
    for stage_name, key, color, label in curves:
        path = out / stage_name / "train.json"
        pts = json.loads(path.read_text())["losses"].get(key) if path.is_file() else None
        if pts:
            series.append((label, color, _smooth(pts, 25)))
    loss_axes(chart, [s[2] for s in series])
    for _label, color, pts in series:
        chart.line(pts, color)
    chart.legend((655, 50), [(label, color, "line") for label, color, _ in series])
    return chart.save(out / "losses.png")


def stage(name: str, cfg: dict, out: Path, max_steps: int, chunk: int, goal: float | None,
          keep: Path | None = None, variant: str = "diagonal") -> Path:
    """Train stage ``name`` in chunks to ``max_steps`` (resuming from its ``state.pt``), quick-checking after each;
    ``keep``: export the EMA there after each chunk too (bf16, committable: a later sitting without the state
    warm-starts from it with ``--dmd-init``), with ``<keep>.json`` beside it (the stage, the iteration, the check)."""
    from sdvg.train import load_config, train_diagonal

    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    log = out / "eval.jsonl"
    done = 0
    state = d / "state.pt"
    if state.is_file():
        from sdvg.loaders.checkpoint import torch_load

        done = int(torch_load(state)["step"])
    while done < max_steps:
        done = min(max_steps, done + chunk)
        t0 = time.time()
        res = train_diagonal(load_config(None, **{**cfg, "out": str(d), "steps": done}))
        tail = {k: sum(v for _, v in vals[-chunk:]) / len(vals[-chunk:]) for k, vals in res.losses.items() if vals}
        row = {"stage": name, "step": done, "train_s": round(time.time() - t0, 1), "loss": tail,
               **evaluate(res.student, QUICK_SEEDS, variant=variant)}
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if keep is not None:
            export(res.student, keep)
            note = {k: v for k, v in row.items() if k != "accuracies"}
            keep.with_suffix(".json").write_text(json.dumps({**note, "config": cfg}, indent=1) + "\n", encoding="utf-8")
        logging.info("%s", json.dumps(row))
        if goal is not None and row["judge"] >= goal:
            logging.info("%s reached the goal %.3f at step %d", name, goal, done)
            break
    return d / "student.pt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/recipe")
    ap.add_argument("--pairs", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=150)
    ap.add_argument("--ode-steps", type=int, default=3000)
    ap.add_argument("--ode-lr", type=float, default=1e-4)
    ap.add_argument("--ode-init", help="the ODE stage's starting weights (default: the teacher's): a student .pt of "
                    "another architecture distils the teacher into a smaller model (docs/TRAINING.md)")
    ap.add_argument("--dmd-steps", type=int, default=1500)
    ap.add_argument("--dmd-lr", type=float, default=2e-5)
    ap.add_argument("--fake-lr", type=float, default=1e-4)
    ap.add_argument("--dmd-regression", type=float, default=0.25)
    ap.add_argument("--target-ratio", type=float, default=0.9)
    ap.add_argument("--skip-dmd", action="store_true")
    ap.add_argument("--plot", action="store_true", help="write losses.png from the stages' train.json and exit")
    ap.add_argument("--export", nargs=2, metavar=("SRC", "DST"), help="write SRC student.pt's EMA in bf16 to DST")
    ap.add_argument("--install", nargs=2, metavar=("SRC", "TREE"), help="make SRC student.pt's EMA the drafter of the "
                    "toy models TREE (file, stamp, its own sampling), with --provenance JSON, and exit")
    ap.add_argument("--provenance", default="{}", help="--install: JSON of how the student was made (command, seeds, "
                    "steps, measured ratio)")
    ap.add_argument("--final", help="measure this student.pt on the final held-out pairs (final.json) and exit")
    ap.add_argument("--keep", type=Path, help="after each chunk, export the EMA student (bf16) to this path: commit it "
                    "so that a sitting that loses the run's state resumes with --dmd-init KEEP")
    ap.add_argument("--captions", choices=sorted(CAPTION_SETS), default="heldout", help="heldout (default): train on "
                    "the world's training captions, judge its held-out ones; v1: the first world's 72 captions for "
                    "both, held out by seed (the first-world toy target's protocol)")
    ap.add_argument("--dmd-init", default="ode", help="ode (default), teacher: DMD straight from the teacher's "
                    "weights (it already samples on the student's schedule), skipping the ODE stage, or a student "
                    ".pt to warm-start DMD from (its weights only: a fresh fake score and optimiser, stage dmd-warm)")
    ap.add_argument("--variant", choices=ABLATIONS, default="diagonal", help="goal 3's ablations of the DMD stage: "
                    "diagonal (the recipe), no-flow (flow_weight 0), clean-cache (Self-Forcing's clean re-run), "
                    "constant (4 steps every block); each trains in its own stage folder and is checked as trained")
    args = ap.parse_args()
    if args.dmd_init not in ("ode", "teacher") and not Path(args.dmd_init).is_file():
        ap.error(f"--dmd-init {args.dmd_init}: no such file (give ode, teacher or a student .pt)")
    if args.ode_init and not Path(args.ode_init).is_file():
        ap.error(f"--ode-init {args.ode_init}: no such file (give a student .pt)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    _captions["set"] = args.captions
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        logging.info("wrote %s", plot(out))
        return
    if args.export:
        logging.info("wrote %s", export(*map(Path, args.export)))
        return
    if args.install:
        logging.info("wrote %s", install(*map(Path, args.install), json.loads(args.provenance)))
        return
    if args.final:
        logging.info("%s", json.dumps(final(out, Path(args.final), FINAL_SEEDS)))
        return
    teacher = teacher_row(out, QUICK_SEEDS)
    logging.info("teacher on the quick held-out check: %s", json.dumps(teacher))
    goal = args.target_ratio * teacher["judge"]
    if args.dmd_init == "teacher":
        from sdvg.toy.preset import toy_files

        stage(stage_name("dmd-from-teacher", args.variant), dmd_config(args, toy_files()["target"]), out,
              args.dmd_steps, args.chunk, None, args.keep, args.variant)
        return
    if args.dmd_init != "ode":
        stage(stage_name("dmd-warm", args.variant), dmd_config(args, Path(args.dmd_init)), out, args.dmd_steps,
              args.chunk, None, args.keep, args.variant)
        return
    student = stage("ode", ode_config(args), out, args.ode_steps, args.chunk, goal)
    if not args.skip_dmd:
        pairs, link = out / "ode" / "ode_pairs.pt", out / "dmd" / "ode_pairs.pt"
        link.parent.mkdir(parents=True, exist_ok=True)
        if pairs.is_file() and not link.exists():
            link.symlink_to(pairs.resolve())  # the same teacher pairs (their key matches), made once
        stage("dmd", dmd_config(args, student), out, args.dmd_steps, args.chunk, None, args.keep)


if __name__ == "__main__":
    main()
