"""Generated source files on disk, named by a hash of their content, under
`torchweld.config.cache_dir`: a second process finds them already built."""
from __future__ import annotations

import hashlib
import os
import tempfile


def cache_dir(kind: str) -> str:
    from torchweld import config  # read at call time: tests patch it

    path = os.path.join(config.cache_dir, kind)
    os.makedirs(path, exist_ok=True)
    return path


def content_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def write_once(path: str, text: str) -> str:
    """Write `text` to `path` atomically unless it is already there."""
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return path
