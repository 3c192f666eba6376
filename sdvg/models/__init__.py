"""The torch modules: the causal DiT and its KV caches, the streaming VAE (and the toy patch latent model), the
ImageReward verifier, the UMT5 text encoder and the transformer-block offloader, and the
quantized Linear layer GGUF and scaled-fp8 DiTs keep their weights in. Models read no files: the
``loaders`` package turns files into these modules."""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "dit": "CausalWanTransformer dit_param_shapes",
    "kv_cache": "CrossAttnCache SelfKVCache kv_cache_nbytes",
    "offload": "BlockOffloader move_model offload_model parse_offload",
    "patch_vae": "PatchVAE",
    "quant": "QuantLinear QuantTensor ScaledFP8 is_stored_quant quant_summary",
    "reward": "ImageReward ImageRewardConfig",
    "text_encoder": "TextEncoder",
    "vae": "StreamingVAE VAEState",
})
