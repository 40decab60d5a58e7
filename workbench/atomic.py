"""Atomic file writes: write to a temporary name in the same folder, flush, then rename into place.

A reader (or an interrupted run) therefore sees either the old file or the new one, never half of one.
``os.replace`` is atomic on POSIX and Windows when source and target are on the same file system, which the
temporary name in the target's own folder guarantees.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TEMP_PREFIX = ".tmp-"


@contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit it replaces ``path``, on an error it is removed.

    ``mode`` is ``"w"`` (text) or ``"wb"`` (bytes).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX + target.name + ".", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_open(path, "w") as handle:
        handle.write(text)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)
    return Path(path)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Serialise ``obj`` as indented JSON and write it atomically.

    The object is serialised completely before the file is touched, so a value JSON cannot hold raises
    ``TypeError`` and leaves any existing file as it was.
    """
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n"
    return atomic_write_text(path, text)
