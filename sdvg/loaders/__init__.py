"""Model files → the ``models``: file checks, safetensors and checkpoint reading, the Wan DiT, VAE, ImageReward and
LoRA formats, ``inspect``, and the model bundle one generation runs on (``bundle``)."""
