"""Loaded models kept across prompts, keyed by (kind, path, file size, mtime, dtype, device).

V3 nodes are classmethods on a per-call sanitized class, so the cache lives at module level. A re-run of the
same workflow reuses the models; a changed file on disk (size or mtime) is reloaded. Each kind keeps at most
``MAX_PER_KIND`` entries (least recently used goes first), so switching files does not pile models up.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from . import _host

logger = logging.getLogger(__name__)

MAX_PER_KIND = 2  # a drafter and a target can be loaded by the same loader kind at once

_lock = threading.Lock()
_entries: OrderedDict[tuple, Any] = OrderedDict()


def file_key(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns)


def get_or_load(kind: str, path: str, dtype: str, device: str, load: Callable[[], Any]) -> Any:
    key = (kind, *file_key(path), dtype, device)
    with _lock:
        if key in _entries:
            _entries.move_to_end(key)
            return _entries[key]
    value = load()
    with _lock:
        _entries[key] = value
        same_kind = [k for k in _entries if k[0] == kind]
        for old in same_kind[:-MAX_PER_KIND]:
            logger.info("dropping cached %s %s", kind, old[1])
            del _entries[old]
    _host.soft_empty_cache()
    return value


def size() -> int:
    return len(_entries)
