"""The model bundle a sampler runs on, and loading it from files or a ComfyUI-style models tree."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..devices import resolve_device
from ..errors import ConfigError, ModelFileError
from .file_checks import require_path

if TYPE_CHECKING:
    from ..models.reward import ImageReward
    from ..models.text_encoder import TextEncoder
    from ..models.vae import StreamingVAE
    from .lora import LoraSpec

logger = logging.getLogger(__name__)

MODEL_FOLDERS = {
    "drafter": "diffusion_models",
    "target": "diffusion_models",
    "vae": "vae",
    "text_encoder": "text_encoders",
    "reward": "image_reward",
}
# File-name hints used to pick files from a models tree when no explicit file is given.
NAME_HINTS = {
    "drafter": ("sdvg_tiny_drafter", "self_forcing", "drafter"),
    "target": ("sdvg_tiny_target", "krea", "target"),
    "vae": ("sdvg_tiny_vae", "wan_2.1_vae", "wan2.1_vae", "vae"),
    "text_encoder": ("sdvg_tiny_umt5", "umt5", "t5"),
    "reward": ("sdvg_tiny_image_reward", "sdvg_toy_critic", "imagereward", "image_reward"),
}
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".ckpt", ".sft", ".bin")


@dataclass
class SDVGModels:
    """Everything one generation needs. Any DiT may be ``None`` when the routing mode never calls it."""

    target: torch.nn.Module | None
    drafter: torch.nn.Module | None
    vae: StreamingVAE
    text_encoder: TextEncoder | None = None
    reward: ImageReward | None = None

    @property
    def target_device(self) -> torch.device | None:
        return _module_device(self.target)



def _module_device(module: torch.nn.Module | None) -> torch.device | None:
    if module is None:
        return None
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def stamped_file(models_dir: str | Path, role: str) -> Path | None:
    """The file a tree's stamp names for ``role``: a tree our trainers write carries ``sdvg_<name>.json`` whose
    ``files`` map gives each role's file (relative to the tree), so a tree holding several DiTs — the toy world's
    flow-matching drafter beside its distilled student — says which one is which. None without such a stamp."""
    from .stamp import tree_stamps

    for stamp in tree_stamps(models_dir):
        files = stamp.get("files") or {}
        if isinstance(files, dict) and files.get(role):
            return Path(models_dir) / str(files[role])
    return None


def find_model_file(models_dir: str | Path, role: str) -> Path:
    """Pick the file for ``role`` from a ComfyUI-style models tree: the one its stamp names (:func:`stamped_file`),
    else by folder and name hints."""
    stamped = stamped_file(models_dir, role)
    if stamped is not None:
        return stamped
    folder = Path(models_dir) / MODEL_FOLDERS[role]
    if not folder.is_dir():
        raise ModelFileError(
            f"No '{MODEL_FOLDERS[role]}' folder in {models_dir} (needed for the {role}). "
            "Pass the file explicitly or run `python -m sdvg make-tiny DIR` for the tiny preset."
        )
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in WEIGHT_SUFFIXES or (p / "config.json").is_file())
    for hint in NAME_HINTS[role]:
        matches = [p for p in files if hint in p.name.lower()]
        if matches:
            return matches[0]
    raise ModelFileError(
        f"Could not find a {role} file in {folder} (looked for names containing {', '.join(NAME_HINTS[role])}). "
        f"Found: {', '.join(p.name for p in files) or 'nothing'}. Pass the file explicitly."
    )


def load_models(
    models_dir: str | Path | None = None,
    *,
    drafter: str | Path | None = None,
    target: str | Path | None = None,
    vae: str | Path | None = None,
    text_encoder: str | Path | None = None,
    reward: str | Path | None = None,
    need: tuple[str, ...] = ("drafter", "target", "vae", "text_encoder", "reward"),
    dit_device: str = "auto",
    aux_device: str = "auto",
    dtype: str = "auto",
    dtypes: dict[str, str | None] | None = None,
    loras: dict[str, Sequence[LoraSpec]] | None = None,
    offload: dict[str, int | str | None] | None = None,
    text_device: str | None = None,
    pt_weights: str = "ema",
) -> SDVGModels:
    """Load the models named in ``need``: explicit files win, the rest is looked up in ``models_dir``.
    ``pt_weights`` picks a training ``.pt``'s weights (``compat.Compat.pt_weights``).

    Every missing file is reported at once, and every LoRA is checked against its DiT's header before anything
    loads. ``dtypes``: per DiT role ("target", "drafter") its weight dtype where it differs from ``dtype`` (the
    24 GB set-up: ``dtypes={"target": "fp8_e4m3fn"}`` beside a bf16 drafter). ``loras``/``offload``: per DiT role ("target", "drafter"), the LoRAs merged at load and the block offload
    setting (see ``wan_loading.load_dit``); ``text_device``: the text encoder's own device (default ``aux_device``).
    The text encoder loads first and each DiT is checked against it (and the drafter against the target) right after
    it loads, so a mismatched file is named before the rest is loaded."""
    from ..models.dit import check_dit_pair
    from .reward import load_image_reward
    from .text_encoder import load_text_encoder
    from .vae_open import open_vae
    from .wan import load_dit

    explicit = {"drafter": drafter, "target": target, "vae": vae, "text_encoder": text_encoder, "reward": reward}
    paths = _model_paths(need, explicit, models_dir)
    warn_if_drafter_larger(inspect_dits(paths))
    prepared = _check_loras(loras or {}, paths)
    dit_dev = resolve_device(dit_device, what="DiTs")
    aux_dev = resolve_device(aux_device, what="text encoder, VAE and reward model")
    aux_dtype = torch.float32 if aux_dev.type == "cpu" else torch.bfloat16
    text_dev = aux_dev if text_device is None else resolve_device(text_device, what="text encoder")
    # on the CPU beside CUDA DiTs the encoder runs once per prompt in bf16 (half the RAM of fp32; the DiTs read bf16)
    text_dtype = torch.bfloat16 if text_dev.type != "cpu" or dit_dev.type == "cuda" else torch.float32
    logger.info("loading models: %s", {k: str(v) for k, v in paths.items()})
    encoder = (load_text_encoder(paths["text_encoder"], device=text_dev, dtype=text_dtype)
               if "text_encoder" in paths else None)
    dits: dict[str, torch.nn.Module] = {}
    for role in ("target", "drafter"):
        if role in paths:
            role_dtype = (dtypes or {}).get(role) or dtype
            dits[role] = load_dit(paths[role], dtype=role_dtype, device=dit_dev, loras=prepared.get(role, ()),
                                  offload_blocks=(offload or {}).get(role), pt_weights=pt_weights)
            check_text_width(encoder, paths.get("text_encoder"), dits[role], role, paths[role])
    if len(dits) == 2:
        check_dit_pair(dits["target"].config, dits["drafter"].config, target_name=f"the target {paths['target']}",
                       drafter_name=f"the drafter {paths['drafter']}")
    return SDVGModels(
        target=dits.get("target"),
        drafter=dits.get("drafter"),
        vae=open_vae(paths["vae"], device=aux_dev, dtype=aux_dtype),
        text_encoder=encoder,
        reward=load_image_reward(paths["reward"], device=aux_dev) if "reward" in paths else None,
    )


def model_paths(models_dir: str | Path | None, need: Sequence[str], **explicit) -> dict[str, Path]:
    """The file of every role in ``need`` (``explicit``: role → file or None, as ``load_models`` takes them), checked
    as ``load_models`` checks them, without reading any."""
    return _model_paths(need, {role: explicit.get(role) for role in MODEL_FOLDERS}, models_dir)


def _model_paths(need: Sequence[str], explicit: dict, models_dir) -> dict[str, Path]:
    """The file of every role in ``need``; all the missing or misplaced ones named in one error."""
    unknown = [need] if isinstance(need, str) else [role for role in need if role not in MODEL_FOLDERS]
    if unknown:
        raise ConfigError(f"Unknown model role(s) {unknown} in need=; the roles are "
                          f"{', '.join(MODEL_FOLDERS)} (a tuple of them, e.g. need=(\"target\", \"vae\")).")
    paths, problems = {}, []
    for role in need:
        try:
            paths[role] = _model_path(role, explicit[role], models_dir)
        except (ModelFileError, ConfigError) as exc:
            problems.append(exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        kind = ModelFileError if all(isinstance(e, ModelFileError) for e in problems) else ConfigError
        raise kind(f"{len(problems)} model files are missing or unusable:\n" + "\n".join(f"  - {e}" for e in problems))
    return paths


def _check_loras(loras: dict[str, Sequence[LoraSpec]], paths: dict[str, Path]) -> dict[str, list]:
    """Every LoRA read and matched to its DiT's header (no DiT weight is read) → the prepared files per role."""
    from ..models.dit import dit_param_shapes
    from .lora import prepare_loras
    from .wan import inspect_dit_checkpoint

    prepared = {}
    for role, specs in loras.items():
        if not specs:
            continue
        if role not in paths or role not in ("target", "drafter"):
            raise ConfigError(f"LoRAs were given for the {role}, which this run does not load; LoRAs go on the target "
                              "or the drafter DiT.")
        info = inspect_dit_checkpoint(paths[role])
        what = f"the {role} {paths[role]} ({info.size_label})"
        prepared[role] = prepare_loras(specs, dit_param_shapes(info.config), what=what).loras
    return prepared


def _model_path(role: str, explicit: str | Path | None, models_dir: str | Path | None) -> Path:
    if explicit is not None:
        path = Path(explicit)
    elif models_dir is not None:
        path = find_model_file(models_dir, role)
    else:
        option = "--" + role.replace("_", "-")
        raise ConfigError(f"No {role.replace('_', ' ')} file given and no models folder to look in: pass {option} FILE "
                          "or --models DIR (a ComfyUI models folder).")
    require_path(path, f"The {role} file {path} does not exist. Fix the path, or put the file in "
                 f"models/{MODEL_FOLDERS[role]}/.")
    return path


def inspect_dits(paths: dict[str, Path]) -> dict:
    """The header of each DiT file among ``paths`` (role → ``DiTCheckpointInfo``); no weight is read."""
    from .wan import inspect_dit_checkpoint

    return {role: inspect_dit_checkpoint(paths[role]) for role in ("target", "drafter") if role in paths}


def forward_work(info) -> float:
    """What one forward of a DiT costs, up to a constant: its parameters × its tokens per latent pixel (a patch-1×1
    model reads 4 × the tokens of a patch-2×2 one)."""
    _, p_h, p_w = info.config["patch_size"]
    return info.num_params / (p_h * p_w)


def warn_if_drafter_larger(infos: dict) -> None:
    """A drafter whose forward costs more than its target's (parameters × tokens) is legal but almost always the two
    files swapped: say so."""
    if "target" in infos and "drafter" in infos and forward_work(infos["drafter"]) > forward_work(infos["target"]):
        d, t = infos["drafter"], infos["target"]
        logger.warning("the drafter %s (%s, %.3gM params) is larger than the target %s (%s, %.3gM params) per "
                       "forward: were --drafter and --target swapped? Speculative decoding saves time only with a "
                       "small drafter.", d.path, d.size_label, d.num_params / 1e6, t.path, t.size_label,
                       t.num_params / 1e6)


UMT5_XXL_WIDTH = 4096  # d_model of UMT5-XXL = text_dim of every Wan 2.1 DiT


def check_text_width(encoder: TextEncoder | None, encoder_path: Path | None, dit: torch.nn.Module, role: str,
                     dit_path: Path) -> None:
    """The text encoder's output width must be the DiT's ``text_dim`` (otherwise the DiT's text projection fails
    with "mat1 and mat2 shapes cannot be multiplied" at the first step)."""
    want = int(dit.config["text_dim"])
    if encoder is None or encoder.text_dim == want:
        return
    fix = (f"use the UMT5-XXL encoder that matches these DiTs ({want} wide), e.g. umt5_xxl_fp8_e4m3fn_scaled."
           "safetensors or models_t5_umt5-xxl-enc-bf16.pth" if want == UMT5_XXL_WIDTH
           else f"use the text encoder this DiT was made with ({want} wide)")
    raise ConfigError(
        f"The text encoder {encoder_path} gives {encoder.text_dim}-wide embeddings, but the {role} DiT {dit_path} takes "
        f"text_dim {want}: {fix}."
    )
