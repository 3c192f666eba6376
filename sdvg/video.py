"""Writing results: mp4 through PyAV, and safetensors dumps of latents and frames."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import torch

from .errors import ConfigError
from .outputs import SDVG_OUTPUT_KEY, write_atomic

WAN_FPS = 16


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """[F, H, W, 3] float in [0, 1] (or uint8) → contiguous uint8 on the CPU."""
    if frames.dtype == torch.uint8:
        return frames.cpu().contiguous()
    return (frames.detach().float().cpu() * 255.0).round_().clamp_(0, 255).to(torch.uint8).contiguous()


def write_mp4(frames: torch.Tensor, path: str | Path, *, fps: int = WAN_FPS, crf: int = 18) -> Path:
    """Encode ``[F, H, W, 3]`` frames to H.264 (yuv420p) mp4 (MPEG-4 Part 2 if libx264 is absent), atomically: a
    failed write (full disk, killed process) leaves no broken file."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ConfigError(f"Expected frames [F, H, W, 3] with F ≥ 1, got {tuple(frames.shape)}.")
    data = to_uint8(frames).numpy()
    return write_atomic(path, lambda tmp: _encode_mp4(data, tmp, fps, crf))


def _encode_mp4(data, path: Path, fps: int, crf: int) -> None:
    import av

    height, width = data.shape[1:3]
    pad_h, pad_w = height % 2, width % 2  # yuv420p needs even sizes
    with av.open(str(path), mode="w") as container:
        try:
            stream = container.add_stream("libx264", rate=Fraction(fps))
            stream.options = {"crf": str(crf)}
        except Exception:  # noqa: BLE001 - codec availability depends on the FFmpeg build
            stream = container.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width + pad_w, height + pad_h, "yuv420p"
        for frame in data:
            if pad_h or pad_w:
                import numpy as np

                frame = np.pad(frame, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def read_mp4_frame_count(path: str | Path) -> int:
    import av

    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def save_tensor_file(path: str | Path, name: str, tensor: torch.Tensor, metadata: dict | None = None) -> Path:
    """One tensor as safetensors (atomically), marked as an SDVG output so a rerun may overwrite it."""
    from safetensors.torch import save_file

    meta = {SDVG_OUTPUT_KEY: name, **{k: str(v) for k, v in (metadata or {}).items()}}
    data = {name: tensor.detach().cpu().contiguous()}
    return write_atomic(path, lambda tmp: save_file(data, str(tmp), metadata=meta))
