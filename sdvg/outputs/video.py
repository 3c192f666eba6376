"""Writing results: mp4 through PyAV (whole, or fed block by block as a video is made), and safetensors dumps of
latents and frames."""

from __future__ import annotations

import contextlib
import os
from fractions import Fraction
from pathlib import Path

import torch

from ..errors import ConfigError
from .files import SDVG_OUTPUT_KEY, apply_user_mode, temp_beside, write_atomic

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
    data = to_uint8(frames)
    return write_atomic(path, lambda tmp: _encode_all(data, tmp, fps, crf))


def _encode_all(data: torch.Tensor, path: Path, fps: int, crf: int) -> None:
    with _Encoder(path, fps, crf) as enc:
        enc.write(data)


class _Encoder:
    """One open mp4 container: frames go in as they come; the stream is set up from the first frame's size."""

    def __init__(self, path: Path, fps: int, crf: int) -> None:
        import av

        self.av = av
        self.container = av.open(str(path), mode="w")
        self.fps, self.crf = fps, crf
        self.stream = None
        self.pad = (0, 0)

    def __enter__(self) -> _Encoder:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is None and self.stream is not None:
                for packet in self.stream.encode():
                    self.container.mux(packet)
        finally:
            self.container.close()

    def _open_stream(self, height: int, width: int) -> None:
        try:
            stream = self.container.add_stream("libx264", rate=Fraction(self.fps))
            stream.options = {"crf": str(self.crf)}
        except Exception:  # noqa: BLE001 - codec availability depends on the FFmpeg build
            stream = self.container.add_stream("mpeg4", rate=Fraction(self.fps))
        self.pad = (height % 2, width % 2)  # yuv420p needs even sizes
        stream.width, stream.height, stream.pix_fmt = width + self.pad[1], height + self.pad[0], "yuv420p"
        self.stream = stream

    def write(self, frames: torch.Tensor) -> None:
        """uint8 ``[F, H, W, 3]`` on the CPU."""
        if self.stream is None:
            self._open_stream(int(frames.shape[1]), int(frames.shape[2]))
        pad_h, pad_w = self.pad
        for frame in frames.numpy():
            if pad_h or pad_w:
                import numpy as np

                frame = np.pad(frame, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
            for packet in self.stream.encode(self.av.VideoFrame.from_ndarray(frame, format="rgb24")):
                self.container.mux(packet)


class Mp4Stream:
    """An mp4 written block by block while a video is made, so a long video never sits in RAM: ``write`` each
    block's frames, then ``close`` (the file appears atomically under its name) or ``abort`` (nothing is left).
    ``max_frames`` stops writing after that many frames (a ``--frames`` trim)."""

    def __init__(self, path: str | Path, *, fps: int = WAN_FPS, crf: int = 18, max_frames: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = temp_beside(self.path)
        self._fps, self._crf, self.max_frames = fps, crf, max_frames
        self._enc: _Encoder | None = None
        self.frames_written = 0

    def write(self, frames: torch.Tensor) -> None:
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ConfigError(f"Expected frames [F, H, W, 3], got {tuple(frames.shape)}.")
        if self.max_frames is not None:
            frames = frames[: max(self.max_frames - self.frames_written, 0)]
        if not frames.shape[0]:
            return
        if self._enc is None:
            self._enc = _Encoder(self._tmp, self._fps, self._crf)
        try:
            self._enc.write(to_uint8(frames))
        except BaseException:
            self.abort()
            raise
        self.frames_written += int(frames.shape[0])

    def close(self) -> Path:
        """Finish the file and move it into place (a stream with no frame writes nothing: ConfigError)."""
        if self._enc is None:
            raise ConfigError(f"No frame was written to {self.path}.")
        enc, self._enc = self._enc, None
        try:
            enc.__exit__(None, None, None)
            apply_user_mode(self._tmp)
            os.replace(self._tmp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                self._tmp.unlink()
        return self.path

    def abort(self) -> None:
        enc, self._enc = self._enc, None
        if enc is not None:
            with contextlib.suppress(Exception):
                enc.container.close()
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()


def probe_video(path: str | Path) -> tuple[int, int]:
    """(width, height) of a video file's first stream, without decoding it; ConfigError if it is no video."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            return int(stream.codec_context.width), int(stream.codec_context.height)
    except (av.error.FFmpegError, IndexError) as exc:
        raise ConfigError(f"{path} is not a video file PyAV can read ({exc}).") from exc


def read_video_frames(path: str | Path, max_frames: int | None = None) -> torch.Tensor:
    """The first ``max_frames`` frames of a video file as float ``[N, H, W, 3]`` in [0, 1]."""
    import av
    import numpy as np

    frames = []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            frames.append(frame.to_ndarray(format="rgb24"))
            if max_frames is not None and len(frames) >= max_frames:
                break
    if not frames:
        raise ConfigError(f"{path} has no video frames.")
    return torch.from_numpy(np.stack(frames)).float().div_(255.0)


def save_tensor_file(path: str | Path, name: str, tensor: torch.Tensor, metadata: dict | None = None) -> Path:
    """One tensor as safetensors (atomically), marked as an SDVG output so a rerun may overwrite it."""
    from safetensors.torch import save_file

    meta = {SDVG_OUTPUT_KEY: name, **{k: str(v) for k, v in (metadata or {}).items()}}
    data = {name: tensor.detach().cpu().contiguous()}
    return write_atomic(path, lambda tmp: save_file(data, str(tmp), metadata=meta))
