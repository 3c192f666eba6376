"""The torch modules: the causal DiT and its KV caches, the streaming VAE (and the toy patch latent model), the
ImageReward verifier, the UMT5 text encoder and the transformer-block offloader. Models read no files: the
``loaders`` package turns files into these modules."""
