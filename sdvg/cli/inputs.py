"""``generate``'s inputs other than models and settings, checked before anything loads: the prompt, and the starting
frames (``--init-image``, ``--init-video``, ``--init-latents``, ``--v2v-video``).

An image is size-checked from its header before it is decoded: PIL reads the header only, a header that claims more
pixels than PIL's decompression-bomb limit is refused as such, and any other size must be the output's (so what is
decoded is at most one output frame).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .. import ConfigError

SIZE_STEP = 16  # output sizes are multiples of 16


def check_prompts(args, num_blocks: int):
    """The prompt (or prompt timeline) of a ``generate`` run: a non-empty text, or a checked ``PromptSchedule``."""
    from ..sampling import PromptSchedule, check_prompt

    if args.prompt_schedule is not None:
        schedule = PromptSchedule.parse(args.prompt_schedule, blend_blocks=args.blend_blocks)
        schedule.check_blocks(num_blocks)
        return schedule
    if args.blend_blocks:
        raise ConfigError("--blend-blocks goes with --prompt-schedule.")
    return check_prompt(args.prompt)


def check_start_frames(args, config) -> None:
    """The starting-frames options, before any model loads: files, sizes and the strength."""
    from ..outputs import probe_video
    from ..sampling import check_strength

    if (args.v2v_video is None) != (args.strength is None):
        raise ConfigError("--v2v-video and --strength go together (strength 0 = the video itself … 1 = text-to-video).")
    if args.strength is not None:
        check_strength(args.strength)
    for option in ("init_image", "init_video", "init_latents", "v2v_video"):
        path = getattr(args, option)
        flag = "--" + option.replace("_", "-")
        if path is None:
            continue
        if not Path(path).is_file():
            raise ConfigError(f"{flag} {path} does not exist.")
        if option == "init_latents":
            continue
        size = image_size(path) if option == "init_image" else probe_video(path)
        if size != (config.width, config.height):
            raise ConfigError(size_mismatch(flag, size, (config.width, config.height)))


def size_mismatch(flag: str, size: tuple[int, int], out: tuple[int, int]) -> str:
    """The fix for a starting image or video whose size is not the output's: pass its size where that is a valid
    output size (multiples of 16), else resize it."""
    (w, h), (ow, oh) = size, out
    text = f"{flag} is {w}×{h} but the output is {ow}×{oh}; "
    if w >= SIZE_STEP and h >= SIZE_STEP and w % SIZE_STEP == 0 and h % SIZE_STEP == 0:
        return text + f"pass --width {w} --height {h}, or resize it to {ow}×{oh}."
    return text + (f"resize it to {ow}×{oh} (its own size cannot be the output's: output sides are multiples of "
                   f"{SIZE_STEP}).")


def image_size(path) -> tuple[int, int]:
    """(width, height) from the image's header; nothing is decoded. A header claiming more pixels than PIL's
    decompression-bomb limit is refused."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size check below bounds it
            with Image.open(path) as img:
                return img.size
    except Image.DecompressionBombError as exc:
        raise ConfigError(f"--init-image {path}: its header claims more pixels than an image can safely be decoded "
                          f"with ({exc}); give an image of the output's size.") from exc
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"--init-image {path} is not an image file ({exc}).") from exc


def v2v_video(args, config, vae):
    if args.v2v_video is None:
        return None
    from .. import pixel_frames_for_blocks
    from ..outputs import read_video_frames
    from ..sampling import VideoToVideo

    frames = read_video_frames(args.v2v_video, pixel_frames_for_blocks(config.num_blocks))
    return VideoToVideo.from_frames(vae, frames, args.strength, config.num_blocks)


def init_blocks(args, vae):
    """The given first blocks (``--init-latents``, ``--init-image``, ``--init-video``), or None; the image was
    size-checked by :func:`check_start_frames`."""
    from ..sampling import InitBlocks

    if args.init_latents is not None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return InitBlocks(load_file(args.init_latents)["latents"])
        except (SafetensorError, KeyError, OSError) as exc:
            raise ConfigError(f"--init-latents {args.init_latents} is not a --save-latents file ({exc}).") from exc
    if args.init_image is not None:
        import numpy as np
        import torch
        from PIL import Image

        with Image.open(args.init_image) as img:
            frame = torch.from_numpy(np.asarray(img.convert("RGB"))).float().div_(255.0)[None]
        return InitBlocks.from_frames(vae, frame)
    if args.init_video is not None:
        from ..outputs import read_video_frames

        return InitBlocks.from_frames(vae, read_video_frames(args.init_video))
    return None
