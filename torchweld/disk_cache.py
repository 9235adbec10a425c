"""Generated source files and what is built from them, on disk, named by a hash of
their content, under `torchweld.config.cache_dir`: a second process finds them already
built. Used by the kernel loaders (runtime/) and the guard evaluator (capture/)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile


_made: set[str] = set()  # folders made by this process (a system call less per file)


def cache_dir(kind: str) -> str:
    from torchweld import config  # read at call time: tests patch it

    path = os.path.join(config.cache_dir, kind)
    if path not in _made:
        os.makedirs(path, exist_ok=True)
        _made.add(path)
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
        os.makedirs(os.path.dirname(path), exist_ok=True)  # removed since cache_dir made it, perhaps
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return path


def compile_once(command: list[str], target: str, error: type[Exception]) -> str:
    """Run the compiler `command` with `-o <temporary file>` and rename the result to
    `target`, unless `target` is there already: processes building at once never see
    half a file. A failing compiler raises `error` with the end of its messages."""
    if os.path.exists(target):
        return target
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([*command, "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise error(f"{' '.join(command)} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
