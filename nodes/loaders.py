"""Loader nodes: one file from a ComfyUI model folder → an SDVG socket value, cached across prompts."""

from __future__ import annotations

import os

from comfy_api.latest import io

from ..sdvg import AUX_DTYPES, DIT_DTYPES
from . import _host, _models
from .handles import OFFLOAD_POLICIES, AuxHandle, DiTHandle
from .types import SDVG_DIT, SDVG_REWARD, SDVG_TEXT_ENCODER, SDVG_VAE

CATEGORY = "SDVG/loaders"


def _device_input(tooltip: str) -> io.Combo.Input:
    return io.Combo.Input("device", options=_host.device_options(), default="auto", tooltip=tooltip)


def _file_input(folder: str, what: str, *, gguf: bool = False) -> io.Combo.Input:
    return io.Combo.Input(
        "model_name",
        options=_host.list_model_files(folder, gguf=gguf),
        tooltip=f"The {what} file, from the ComfyUI '{folder}' model folder (or the folders extra_model_paths.yaml maps to it).",
    )


def _resolve(device: str, what: str):
    from ..sdvg import resolve_device

    return resolve_device(device, what=what)


def _aux_dtype(dtype: str, device):
    import torch

    from ..sdvg import parse_dtype

    default = torch.float32 if device.type == "cpu" else torch.bfloat16
    return parse_dtype(dtype, default=default)


def _load_aux(kind: str, folder: str, model_name: str, device: str, dtype, what: str, loader) -> AuxHandle:
    """Shared body of the text-encoder, VAE and reward loaders: resolve, load once (through ComfyUI's memory manager)."""
    path = _host.full_model_path(folder, model_name)
    dev = _resolve(device, what)
    torch_dtype = _aux_dtype(dtype, dev) if dtype is not None else None

    def load():
        if torch_dtype is None:
            return loader(path, device=dev)
        return loader(path, device=dev, dtype=torch_dtype)

    managed = _models.load_file(kind, path, str(torch_dtype or "fp32"), dev, load)
    return AuxHandle(model=managed.model, file=model_name, device=dev, kind=kind, managed=managed)


def model_file_problem(folder: str, model_name: str) -> bool | str:
    """Queue-time check of a loader's file: True, or the message naming the missing file and the folder. ComfyUI
    collects these from every node before it runs anything, so all missing files are reported at once."""
    from ..sdvg import ModelFileError

    try:
        _host.full_model_path(folder, model_name)
    except ModelFileError as exc:
        return str(exc)
    return True


BLOCK_OFFLOAD = ("off", "auto", "custom")


def block_offload_spec(block_offload: str, resident_blocks: int):
    """Widget values → the engine's offload setting: None, "auto" or K resident blocks."""
    from ..sdvg import ConfigError

    if block_offload not in BLOCK_OFFLOAD:
        raise ConfigError(f"Unknown block_offload {block_offload!r}; use one of {', '.join(BLOCK_OFFLOAD)}.")
    if block_offload == "custom":
        if isinstance(resident_blocks, bool) or not isinstance(resident_blocks, int) or resident_blocks < 0:
            raise ConfigError(f"resident_blocks must be a whole number ≥ 0, got {resident_blocks!r}.")
        return int(resident_blocks)
    return None if block_offload == "off" else "auto"


def load_dit_file(path: str):
    """The ``source`` of a file-backed DiT handle: the file with the handle's LoRAs merged on the way in and its
    block offload, once per (file, dtype, device, LoRAs, offload) while anything holds it."""

    def load(handle: DiTHandle):
        from ..sdvg.loaders import LoraSpec, load_dit

        loras = [LoraSpec(p, s) for p, s in handle.loras]
        key = (*_models.file_key(path), handle.dtype, str(handle.device), handle.block_offload,
               tuple((*_models.file_key(p), s) for p, s in handle.loras))
        name = os.path.basename(path) + "".join(f" + {os.path.basename(p)}@{s:g}" for p, s in handle.loras)
        return _models.load("dit", key, name, os.path.getsize(path), handle.device,
                            lambda: load_dit(path, dtype=handle.dtype, device=handle.device, loras=loras,
                                             offload_blocks=handle.block_offload))

    return load


class SDVGModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGModelLoader",
            display_name="SDVG Load Video DiT",
            category=CATEGORY,
            description=(
                "Loads a causal Wan 2.1 DiT (Self-Forcing 1.3B drafter, Krea Realtime 14B target, or any "
                "Self-Forcing-family file). Wire it to the sampler's drafter or target input: the input decides the role. "
                "The file is read when a run first needs it (after any SDVG Load LoRA in between)."
            ),
            inputs=[
                _file_input("diffusion_models", "DiT checkpoint (.safetensors, .gguf or .pt; GGUF and scaled-fp8 "
                                                "files stay quantized on the device)", gguf=True),
                io.Combo.Input(
                    "weight_dtype",
                    options=list(DIT_DTYPES),
                    default="auto",
                    tooltip="Weight precision. auto = bf16 on GPU, fp32 on CPU. fp8_e4m3fn stores weights in 8 bits and computes in bf16 (about half the memory of bf16). GGUF and scaled-fp8 files keep their quantized weights whatever this says; it picks their compute dtype.",
                ),
                _device_input("Where the DiT runs. auto = cuda:0 when present. The paper keeps both DiTs on cuda:0."),
                io.Combo.Input(
                    "offload",
                    options=list(OFFLOAD_POLICIES),
                    default="keep_loaded",
                    tooltip="keep_loaded: stay on the device between runs (fastest). offload_to_cpu_when_idle: move to CPU RAM after each run to free VRAM for other nodes.",
                ),
                io.Combo.Input(
                    "block_offload",
                    options=list(BLOCK_OFFLOAD),
                    default="off",
                    optional=True,  # workflows and API prompts from before it still run
                    tooltip="Low VRAM: keep only some transformer blocks on the GPU and stream the others from pinned CPU RAM, one block ahead on a side stream (same output, slower). off: every block on the device. auto: as many blocks as fit in the free VRAM. custom: resident_blocks blocks.",
                ),
                io.Int.Input("resident_blocks", default=10, min=0, max=128, optional=True,
                             tooltip="With block_offload = custom: how many transformer blocks stay on the GPU (the 14B has 40, the 1.3B 30)."),
            ],
            outputs=[SDVG_DIT.Output(display_name="dit", tooltip="The DiT; connect to the sampler's drafter or target (or an SDVG Load LoRA first).")],
        )

    @classmethod
    def validate_inputs(cls, model_name: str, block_offload: str = "off", resident_blocks: int = 10) -> bool | str:
        from ..sdvg import ConfigError

        try:
            block_offload_spec(block_offload, resident_blocks)
        except ConfigError as exc:
            return str(exc)
        return model_file_problem("diffusion_models", model_name)

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str, device: str, offload: str, block_offload: str = "off",
                resident_blocks: int = 10) -> io.NodeOutput:
        from ..sdvg import ConfigError, parse_dtype
        from ..sdvg.loaders import inspect_dit_checkpoint

        if offload not in OFFLOAD_POLICIES:
            raise ConfigError(f"Unknown offload policy {offload!r}; use one of {', '.join(OFFLOAD_POLICIES)}.")
        path = _host.full_model_path("diffusion_models", model_name)
        dev = _resolve(device, "DiT")
        parse_dtype(weight_dtype, default=None)  # an unknown dtype fails here, not at the first run
        inspect_dit_checkpoint(path)  # headers only: a broken or foreign file fails on this node, not at the run
        return io.NodeOutput(DiTHandle(file=model_name, dtype=weight_dtype, device=dev, offload=offload,
                                       block_offload=block_offload_spec(block_offload, resident_blocks),
                                       source=load_dit_file(path), lora_base=path))


class SDVGTextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGTextEncoderLoader",
            display_name="SDVG Load UMT5 Text Encoder",
            category=CATEGORY,
            description="Loads the UMT5-XXL text encoder (encoder only) shared by the drafter and the target.",
            inputs=[
                _file_input("text_encoders", "UMT5-XXL text encoder"),
                _device_input("Where the text encoder runs. The paper puts it on the second GPU (cuda:1) with the VAE and the reward model."),
                io.Combo.Input("dtype", options=list(AUX_DTYPES), default="auto", tooltip="Compute precision. auto = bf16 on GPU, fp32 on CPU."),
            ],
            outputs=[SDVG_TEXT_ENCODER.Output(display_name="text_encoder", tooltip="The loaded UMT5 text encoder.")],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return model_file_problem("text_encoders", model_name)

    @classmethod
    def execute(cls, model_name: str, device: str, dtype: str) -> io.NodeOutput:
        from ..sdvg.loaders import load_text_encoder

        handle = _load_aux("text_encoder", "text_encoders", model_name, device, dtype, "text encoder", load_text_encoder)
        return io.NodeOutput(handle)


class SDVGVAELoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGVAELoader",
            display_name="SDVG Load Wan VAE (streaming)",
            category=CATEGORY,
            description="Loads the Wan 2.1 VAE as a streaming decoder that decodes one block at a time and can roll back a rejected draft.",
            inputs=[
                _file_input("vae", "Wan 2.1 VAE"),
                _device_input("Where the VAE decodes. The paper puts it on the second GPU (cuda:1)."),
                io.Combo.Input("dtype", options=list(AUX_DTYPES), default="auto", tooltip="Compute precision. auto = bf16 on GPU, fp32 on CPU."),
            ],
            outputs=[SDVG_VAE.Output(display_name="vae", tooltip="The loaded streaming Wan VAE.")],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return model_file_problem("vae", model_name)

    @classmethod
    def execute(cls, model_name: str, device: str, dtype: str) -> io.NodeOutput:
        from ..sdvg.loaders import open_vae

        return io.NodeOutput(_load_aux("vae", "vae", model_name, device, dtype, "VAE", open_vae))


class SDVGRewardLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        _host.ensure_image_reward_folder()
        return io.Schema(
            node_id="SDVGRewardLoader",
            display_name="SDVG Load ImageReward",
            category=CATEGORY,
            description=(
                "Loads ImageReward v1 (BLIP + MLP head) from models/image_reward. Put ImageReward.pt there with the "
                "BERT vocab.txt beside it; nothing is downloaded."
            ),
            inputs=[
                _file_input(_host.IMAGE_REWARD_FOLDER, "ImageReward checkpoint (ImageReward.pt; vocab.txt must sit beside it)"),
                _device_input("Where the reward model scores frames. The paper puts it on the second GPU (cuda:1)."),
            ],
            outputs=[SDVG_REWARD.Output(display_name="reward", tooltip="The loaded ImageReward scorer.")],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        _host.ensure_image_reward_folder()
        return model_file_problem(_host.IMAGE_REWARD_FOLDER, model_name)

    @classmethod
    def execute(cls, model_name: str, device: str) -> io.NodeOutput:
        from ..sdvg.loaders import load_image_reward

        _host.ensure_image_reward_folder()
        handle = _load_aux("reward", _host.IMAGE_REWARD_FOLDER, model_name, device, None, "reward model", load_image_reward)
        return io.NodeOutput(handle)
