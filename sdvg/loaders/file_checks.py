"""What a file is from its first bytes, and paths that do not resolve: every loader's "this is not a ..." wording.

A PNG renamed ``.safetensors``, a saved Hugging Face login page, a Git LFS pointer, an empty file, a ZIP that is not a
torch checkpoint, a broken symbolic link: each is named with the fix before any parser sees it.
"""

from __future__ import annotations

import errno
import os
import re
import zipfile
from pathlib import Path

from ..errors import ModelFileError

SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
CORRUPT_HINT = "It is truncated or corrupt (an interrupted download?); download it again."
_HEAD_BYTES = 512


_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"\x1a\x45\xdf\xa3", "a WebM/MKV video"),
    (b"\x1f\x8b", "a gzip archive (.gz / .tar.gz)"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"Rar!", "a RAR archive"),
    (b"%PDF", "a PDF document"),
    (b"GGUF", "a GGUF file (SDVG reads GGUF for the Wan DiTs only, from a file whose name ends in .gguf)"),
)
_PICK = "Pick the model file itself (or download it again if this is what the download gave you)."
_LFS = b"version https://git-lfs"


def _head(path: Path, n: int = _HEAD_BYTES) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)


def _lfs_message(head: bytes) -> str:
    m = re.search(rb"^size (\d+)", head, re.MULTILINE)
    real = f" ({int(m.group(1)) / 1e9:.2f} GB)" if m else ""
    return (f"this is a Git LFS pointer ({len(head)} bytes of text starting 'version https://git-lfs...'), not the "
            f"model: the real file{real} was never downloaded (the repository was cloned without Git LFS). Run "
            "`git lfs install && git lfs pull` in that clone, or download the file directly.")


def _is_html(head: bytes) -> bool:
    start = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return start.startswith((b"<!doctype html", b"<html")) or (start.startswith(b"<") and b"<html" in start)


def _is_torch_zip(path: Path) -> bool:
    """Whether a zip holds a ``torch.save`` checkpoint; unreadable zips count as one (torch then names the damage)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return any(name.endswith("data.pkl") for name in zf.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return True


def _zip_message(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    shown = ", ".join(names[:5]) + (", …" if len(names) > 5 else "")
    files = f"{len(names)} file{'s' if len(names) != 1 else ''}"
    return (f"this is a ZIP archive ({files}: {shown or 'none'}), not a PyTorch checkpoint: unpack it and pick the "
            "model file inside.")


def sniff(path: str | Path) -> str | None:
    """What ``path`` is when its first bytes show it cannot be a checkpoint (with the fix); None when it may be one."""
    path = Path(path)
    if path.stat().st_size == 0:
        return "the file is empty (0 bytes): a failed or interrupted download. Download it again."
    head = _head(path)
    if head.startswith(_LFS):
        return _lfs_message(head)
    for magic, what in _MAGIC:
        if head.startswith(magic) and not (magic == b"GGUF" and path.name.lower().endswith(".gguf")):
            return f"this is {what}, not a checkpoint. {_PICK}"
    if head[4:8] == b"ftyp":
        return f"this is an MP4/MOV video, not a checkpoint. {_PICK}"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return f"this is a WebP image, not a checkpoint. {_PICK}"
    if head.startswith(b"PK\x03\x04") and not _is_torch_zip(path):
        return _zip_message(path)
    if _is_html(head):
        return ("this is an HTML web page, not a checkpoint: the download saved a page (a Hugging Face login, "
                "'access restricted' or error page) instead of the model. Download the file itself again: from "
                "Hugging Face use its download link (…/resolve/main/<file>) or `hf download`, logged in and with the "
                "licence accepted if the repository is gated.")
    return None


def _text_start(head: bytes) -> str | None:
    for cut in range(4):  # the head may end inside a multi-byte character
        try:
            text = head[: len(head) - cut].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    else:
        return None
    if not text or any(not (c.isprintable() or c in "\t\r\n") for c in text):
        return None
    return " ".join(text.split())[:60]


def format_hint(path: Path) -> str:
    """A sentence for a failed read: the file is text, or the other checkpoint format; '' when nothing is known."""
    try:
        head, size = _head(path), path.stat().st_size
    except OSError:
        return ""
    text = _text_start(head)
    if text is not None:
        return (f" It looks like a text file, not a checkpoint (it starts with {text!r}): usually an error message "
                "saved by a failed download. Download the file again.")
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    if not path.name.lower().endswith(SAFETENSORS_SUFFIXES) and 0 < n < size - 8 and head[8:9] == b"{":
        return " It is a safetensors file: rename it to .safetensors."
    if path.name.lower().endswith(SAFETENSORS_SUFFIXES) and (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        return " It is a PyTorch checkpoint (torch.save), not safetensors: rename it to .pt."
    return ""


def broken_link(path: str | Path) -> str | None:
    """'<link> is a broken symbolic link ...' (naming its target) when ``path`` or a folder above it is a symbolic
    link whose target is missing or that loops; None otherwise (including for a plain missing path)."""
    for p in (Path(path), *Path(path).parents):
        if not p.is_symlink() or p.exists():
            continue
        target = os.readlink(p)
        try:
            os.stat(p)
            loop = False
        except OSError as exc:
            loop = exc.errno == errno.ELOOP
        where = (f"it points to {target}, which leads back to itself (a loop)" if loop else
                 f"it points to {target}, which is missing (moved, deleted, renamed, or on a drive that is not mounted)")
        return (f"{p} is a broken symbolic link: {where}. Fix the link (ln -sfn <the real file> {p}) or pass the "
                "real file's path.")
    return None


def require_path(path: str | Path, not_found: str) -> None:
    """A :class:`ModelFileError` when ``path`` is missing: :func:`broken_link`'s message, else ``not_found``."""
    if not Path(path).exists():
        raise ModelFileError(broken_link(path) or not_found)


def check_not_foreign(path: Path) -> None:
    """Raise when the first bytes show that ``path`` is no checkpoint at all (an image, a web page, an LFS pointer)."""
    what = sniff(path)
    if what is not None:
        raise ModelFileError(f"{path}: {what}")
