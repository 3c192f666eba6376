"""Fine-tune a toy target with the object-weighted flow loss, from any target file (the ``target_ft`` stage with
settings from the command line).

    python bench/toy_finetune_target.py --base sdvg/toy/models/diffusion_models/sdvg_toy_target.safetensors \\
        --out out/ft --object-weight 8 --steps 3000 --seed 22
    python bench/toy_finetune_target.py --base ... --out out/ft_pairs --object-weight 8 --shape-pairs --shape-contrast 0.3
    python bench/toy_finetune_target.py --base ... --out out/ft_deep --object-weight 8 --shape-pairs --layers 6
    python bench/toy_finetune_target.py --base ... --out out/ft_white --object-weight 8 --vae out/white_vae.safetensors
    python bench/toy_finetune_target.py --scratch --heads 4 --head-dim 32 --out out/scratch_h4 --steps 5000 --lr 4e-4
    python bench/toy_finetune_target.py --scratch --heads 4 --head-dim 32 --vae out/white_vae.safetensors --out out/scratch_h4w

``--scratch`` trains a target from random weights (the ``target`` stage, the committed target's architecture with
``--heads`` / ``--head-dim`` / ``--layers`` changed) instead of fine-tuning ``--base``; its EMA is exported to
``<out>/checkpoints/sdvg_toy_target.safetensors`` as it goes. With ``--vae`` it trains in that latent file's units
from the start (the file replaces the tree's VAE; there is no base to rescale).

``--out`` becomes a models tree (the committed tree's other files copied in, without a target); the fine-tune's
state lives in ``<out>_work`` (rerun the same command to resume it exactly), its EMA is exported to
``<out>/checkpoints/`` every ``save_every`` steps and, at the end, to ``<out>/diffusion_models/``; the tree's
``sdvg_toy.json`` records the settings. Measure the result with ``bench/toy_heldout.py --dit ... --against ...``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install needed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    start = p.add_mutually_exclusive_group(required=True)
    start.add_argument("--base", help="the target file to start from (Krea's layout)")
    start.add_argument("--scratch", action="store_true", help="train from random weights (seeded by --seed)")
    p.add_argument("--out", required=True, help="a new models tree for the result")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=21)
    p.add_argument("--object-weight", type=float, default=4.0)
    p.add_argument("--edge-weight", type=float, default=0.0)
    p.add_argument("--shape-pairs", action="store_true",
                   help="batches of scene pairs that differ only in shape, sharing noise and sigma")
    p.add_argument("--shape-contrast", type=float, default=0.0,
                   help="lambda in [0, 1): minus lambda x the error against the pair's other shape (needs --shape-pairs)")
    p.add_argument("--layers", type=int, default=None,
                   help="deepen the base to this many layers first (appended blocks with zero output projections: "
                   "the same function at step 0); with --scratch: the number of blocks")
    p.add_argument("--heads", type=int, default=None, help="with --scratch: attention heads (default: the committed 2)")
    p.add_argument("--head-dim", type=int, default=None, help="with --scratch: width of a head (default: 64)")
    p.add_argument("--vae", default=None,
                   help="train in this patch latent file's units (bench/toy_whiten_vae.py): it replaces the tree's "
                   "VAE and the base is rescaled to it from --base-vae's units (dit_train.rescaled_channels); with "
                   "--scratch the target trains in these units from the start")
    p.add_argument("--base-vae", default=None, help="the VAE the base was trained with (default: the committed one)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if not a.scratch and (a.heads or a.head_dim):
        p.error("--heads and --head-dim change the architecture: they need --scratch")
    if a.scratch and a.base_vae:
        p.error("--base-vae names the units of --base: with --scratch there is no base to carry over")
    import torch

    from sdvg.toy import TOY_DIR
    from sdvg.toy.dit_train import DiTTrainSettings
    from sdvg.toy.train import BASE_TARGET, FILES, ToyTrainConfig, default_work_dir, train_toy

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    work = default_work_dir(out)
    ratio = (_channel_ratio(a.base_vae or TOY_DIR / FILES["vae"], a.vae)  # checked before anything is written
             if a.vae and not a.scratch else None)
    if not out.exists():
        shutil.copytree(TOY_DIR, out, ignore=shutil.ignore_patterns(Path(FILES["target"]).name))
        if a.vae:
            shutil.copyfile(a.vae, out / FILES["vae"])
    work.mkdir(parents=True, exist_ok=True)
    spec = ToyTrainConfig().target
    changes = {"layers": a.layers, "heads": a.heads, "head_dim": a.head_dim}
    spec = replace(spec, **{k: v for k, v in changes.items() if v is not None})
    if not a.scratch and not (work / BASE_TARGET).exists():
        _write_base(a.base, work / BASE_TARGET, spec, a.seed, ratio)
    settings = DiTTrainSettings(steps=a.steps, batch=a.batch, lr=a.lr, warmup=100, seed=a.seed,
                                object_weight=a.object_weight, edge_weight=a.edge_weight,
                                shape_pairs=a.shape_pairs, shape_contrast=a.shape_contrast)
    command = "python bench/toy_finetune_target.py " + " ".join(argv if argv is not None else sys.argv[1:])
    config = (ToyTrainConfig(target=spec, target_train=settings, target_finetune=None) if a.scratch
              else ToyTrainConfig(target=spec, target_finetune=settings))
    paths = train_toy(out, work, config=config, stages=("target",) if a.scratch else ("target_ft",),
                      progress=_progress, command=command)
    sys.stdout.write(json.dumps({"target": str(paths["target"])}) + "\n")
    return 0


def _write_base(base: str, dest: Path, spec, seed: int, ratio=None) -> None:
    """The fine-tune's starting file: ``base`` as it is, deepened to ``spec.layers`` and/or rescaled to new latent
    units by ``ratio`` (Krea's layout)."""
    from sdvg.fixtures.tiny import write_krea_safetensors
    from sdvg.loaders.wan import load_dit
    from sdvg.toy.dit_train import deepened, original_state_dict, rescaled_channels

    model = load_dit(base, dtype="fp32", device="cpu")
    if len(model.blocks) == spec.layers and ratio is None:
        shutil.copyfile(base, dest)
        return
    if len(model.blocks) != spec.layers:
        model = deepened(model, spec, seed)
    if ratio is not None:
        model = rescaled_channels(model, ratio)
    write_krea_safetensors(dest, original_state_dict(model), spec.heads)


def _channel_ratio(old_vae, new_vae):
    """New ``latents_std`` / old, per channel (the two patch latent files share their bases)."""
    import torch

    from sdvg.loaders.patch_vae import load_patch_vae

    old, new = (load_patch_vae(v, device="cpu").model for v in (old_vae, new_vae))
    if not torch.equal(old.group_basis, new.group_basis) or not torch.equal(old.first_basis, new.first_basis):
        sys.stderr.write(f"{new_vae} and {old_vae} have different bases: a DiT cannot be carried between them; "
                         "pass --base-vae, the VAE the base was trained with.\n")
        raise SystemExit(2)
    return (new.latents_std / old.latents_std).detach()


def _progress(event: dict) -> None:
    if event["step"] % 100 == 0 or event["step"] == event["steps"]:
        sys.stderr.write(f"step {event['step']}/{event['steps']} loss {event['loss']:.4f} "
                         f"{event['s_per_step']:.2f} s/step\n")


if __name__ == "__main__":
    raise SystemExit(main())
