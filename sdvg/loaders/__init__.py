"""Model files → the ``models``: file checks, safetensors and checkpoint reading, the Wan DiT, VAE, ImageReward and
LoRA formats, ``inspect``, and the model bundle one generation runs on (``bundle``)."""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "bundle": "SDVGModels find_model_file inspect_dits load_models model_paths",
    "from_weights": "core_nbytes core_weight dit_from_weights",
    "scaled_fp8": "split_scales",
    "lora": "LoraSpec parse_lora_arg read_lora",
    "model_info": "describe_model_file",
    "reward": "load_image_reward",
    "text_encoder": "load_text_encoder",
    "vae_open": "open_vae",
    "wan": "inspect_dit_checkpoint load_dit",
})
