"""Output files: every path checked before anything heavy runs, every file written atomically.

:func:`plan_outputs` resolves the outputs a command will write and refuses, with the option's name and the fix,
an unknown extension, a directory, a folder that cannot be written, two outputs on the same path, and an
existing model checkpoint (which an output would silently destroy). :func:`write_atomic` writes through a
temporary file in the same folder and renames it into place, so a full disk or a crash never leaves a broken
file where a good one was, and a failed write leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

# role → (command-line option, allowed suffixes)
OUTPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "video": ("--out", (".mp4",)),
    "report": ("--report", (".json",)),
    "timeline": ("--timeline", (".png",)),
    "latents": ("--save-latents", (".safetensors",)),
    "frames": ("--save-frames", (".safetensors",)),
    "bench_json": ("--json", (".json",)),
    "bench_plot": ("--plot", (".png",)),
}
SDVG_OUTPUT_KEY = "sdvg_output"  # safetensors metadata of the files we write: they may be overwritten
_MODEL_SUFFIXES = (".safetensors", ".sft", ".pt", ".pth", ".ckpt", ".bin", ".gguf")


@dataclass(frozen=True)
class OutputPlan:
    """The checked, resolved output paths of one command, by role."""

    paths: dict[str, Path]

    def __getitem__(self, role: str) -> Path | None:
        return self.paths.get(role)


def plan_outputs(requested: Mapping[str, str | os.PathLike | None]) -> OutputPlan:
    """Check every requested output (role → path or None) before any work; raises ConfigError naming the option."""
    paths: dict[str, Path] = {}
    seen: dict[Path, str] = {}
    for role, raw in requested.items():
        if raw is None:
            continue
        option, suffixes = OUTPUTS[role]
        path = check_output_path(raw, option, suffixes)
        if path in seen:
            raise ConfigError(f"{OUTPUTS[seen[path]][0]} and {option} are the same file ({path}); give each output its "
                              "own path.")
        seen[path] = role
        paths[role] = path
    return OutputPlan(paths)


def check_output_path(raw: str | os.PathLike, option: str, suffixes: tuple[str, ...]) -> Path:
    """One output path: the right extension, not a directory, not a model file, in a folder we can write."""
    text = os.fspath(raw)
    if not text.strip():
        raise ConfigError(f"{option} is empty; give a file name ending in {' or '.join(suffixes)}.")
    path = Path(text).expanduser().absolute()
    if path.suffix.lower() not in suffixes:
        got = f"'{path.suffix}'" if path.suffix else "no extension"
        raise ConfigError(f"{option} {text}: the file must end in {' or '.join(suffixes)} (got {got}).")
    if path.is_dir():
        raise ConfigError(f"{option} {text} is a directory; give a file name inside it, e.g. {path / ('out' + suffixes[0])}.")
    if path.is_file() and _is_foreign_model(path):
        raise ConfigError(f"{option} {text} is an existing model file; writing there would destroy it. Choose another "
                          "path.")
    folder = _existing_ancestor(path.parent)
    if not folder.is_dir():
        raise ConfigError(f"{option} {text}: {folder} is a file, not a folder.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {text}: the folder {folder} is not writable. Choose a folder you can write to.")
    return path


def _existing_ancestor(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _is_foreign_model(path: Path) -> bool:
    """An existing checkpoint that SDVG did not write (our own safetensors outputs carry a metadata marker)."""
    if path.suffix.lower() not in _MODEL_SUFFIXES:
        return False
    if path.suffix.lower() in (".safetensors", ".sft"):
        return SDVG_OUTPUT_KEY not in _safetensors_metadata(path)
    return True


def _safetensors_metadata(path: Path) -> dict:
    try:
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size < 100_000_000:
                return {}
            return json.loads(fh.read(size)).get("__metadata__") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def temp_beside(path: Path) -> Path:
    """The temporary file an atomic write of ``path`` goes through (same folder and extension)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


def user_file_mode() -> int:
    """The mode every file SDVG writes gets: ``0o666`` less the user's umask, what ``open()`` gives a new file (0644
    under the usual umask 022). Some writers (safetensors) create 0600 files of their own; :func:`apply_user_mode`
    puts them under the same rule."""
    return 0o666 & ~_umask()


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask can only read by setting, racing other threads' files)
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_user_mode(path: str | os.PathLike) -> None:
    """Give a written file the user's mode (:func:`user_file_mode`), whatever mode its writer created it with."""
    os.chmod(path, user_file_mode())


def write_json(path: str | os.PathLike, value) -> Path:
    """``value`` as indented JSON (anything else as its ``str``), written atomically: a reader, or a run killed
    mid-write, never sees half a file."""
    import json

    text = json.dumps(value, indent=2, default=str) + "\n"
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_atomic(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` a temporary file beside ``path`` (same extension, so writers that look at it still work), then
    rename it onto ``path``. On any failure the temporary file is removed and the old ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(path)
    try:
        write(tmp)
        apply_user_mode(tmp)  # every output under one permission rule, whatever its writer's own
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path
