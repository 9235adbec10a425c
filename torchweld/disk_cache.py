"""Entries of torchweld's disk cache (generated sources and the libraries built from
them), written atomically and checked before they are used: a damaged entry is
built again, with one warning, never loaded.

    path = write_source("cpp", f"k{key}.cpp", source)           # a file holding exactly `source`
    lib = load_library("cpp", f"k{key}.so", key, build, ctypes.CDLL)
    data = read_sealed("graphs", f"g{key}.json", key)            # None, or what write_sealed wrote
    code = compiled_code(source, path)                           # compile(), kept as a sealed entry

Every entry is written to a temporary file in its folder and renamed into place, so a
reader never sees half of one, whichever processes write at once. An entry is named by
a hash of what it is made from (`content_hash`), and checked against that name when read:

- A source is compared with the text it must hold (the caller has it: it just generated
  it); another text (a corrupt or swapped file) is written again.
- A library carries a seal: 8 bytes of `SEAL` and the SHA-256 of its bytes and of its
  name's key, appended after the ELF image (the dynamic loader reads only what the ELF
  headers point at). Data entries (`write_sealed`: a compiled graph) carry the same seal. The seal is checked before `dlopen`, which must never see a
  truncated file (that raises SIGBUS inside the loader, not an error); a library with no
  seal, a wrong one (truncated, altered, another entry's file) or one that will not load
  is deleted and built again.

Files another user owns are not loaded unless `config.cache_trust_other_users`.
Where entries live (the configured directory, or this process's private one) is
torchweld/cache_root.py's business.
"""
from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import subprocess
import tempfile
import threading
import types
from typing import Callable, TypeVar

from torchweld import cache_root

SEAL = b"TWSEAL01"
_SEAL_SIZE = len(SEAL) + 32
# Part of every library's key: libraries of caches written before seals (or with another
# seal) have other names, and are never mistaken for damaged ones.
LIBRARY_FORMAT = SEAL.decode()
CODE_FORMAT = "code-1"  # part of a compiled_code entry's key

T = TypeVar("T")


def content_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def entry_folder(kind: str) -> str:
    """The folder new entries of `kind` are written to, for files kept by their own
    module (autotuning's choices, written with `replace_file`)."""
    return cache_root.writable_folder(kind)


def replace_file(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (a temporary file renamed into place), as an
    ordinary file (its mode from the umask). Raises OSError where the folder refuses."""
    _write_atomically(path, lambda tmp: _write_bytes(tmp, data), mode=0o666)


# -- sources -------------------------------------------------------------------
def write_source(kind: str, name: str, text: str) -> str:
    """The path of cache file `kind/name` holding exactly `text`: found, or written (again)."""
    data = text.encode()
    for folder in cache_root.folders(kind):
        path = os.path.join(folder, name)
        found, problem = _read_own(path)
        if found == data:
            return path
        if found is not None:
            problem = "is damaged: it does not hold the text its name stands for"
        if problem is not None:
            _damaged(path, problem, "writing it again")
    return _write_entry(kind, name, lambda tmp: _write_bytes(tmp, data), mode=0o666)


# -- libraries -----------------------------------------------------------------
def load_library(kind: str, name: str, key: str, build: Callable[[str], None], open_library: Callable[[str], T]) -> T:
    """`open_library(path)` of library `kind/name`, whose seal holds `key`: found and its
    seal checked, or built by `build(path)` (which writes a fresh library to `path`).
    A found library that will not open is deleted and built again, once."""
    path, built = library(kind, name, key, build)
    try:
        return open_library(path)
    except (OSError, ImportError) as e:
        if built:
            raise
        _damaged(path, f"does not load ({e})", "building it again")
        path, _ = library(kind, name, key, build)
        return open_library(path)


def library(kind: str, name: str, key: str, build: Callable[[str], None]) -> tuple[str, bool]:
    """(the path of library `kind/name` with a sound seal for `key`, whether this call built it)."""
    for folder in cache_root.folders(kind):
        path = os.path.join(folder, name)
        problem = _seal_problem(path, key)
        if problem is None:
            return path, False
        if problem is not _MISSING:
            _damaged(path, problem, "building it again")

    def build_sealed(tmp: str) -> None:
        build(tmp)
        _seal(tmp, key)

    return _write_entry(kind, name, build_sealed, mode=0o777), True


def compiler_build(command: list[str], error: type[Exception]) -> Callable[[str], None]:
    """A `build` for `library`: runs the compiler `command` with `-o <path>`; a failing
    compiler raises `error` with the end of its messages."""
    def build(path: str) -> None:
        proc = subprocess.run([*command, "-o", path], capture_output=True, text=True)
        if proc.returncode != 0:
            raise error(f"{' '.join(command)} failed:\n{proc.stderr[-4000:]}")

    return build


# -- sealed data ---------------------------------------------------------------
def read_sealed(kind: str, name: str, key: str) -> bytes | None:
    """The data of entry `kind/name` written by `write_sealed` for `key`, or None where it is
    missing; a damaged one (truncated, altered, another entry's) is deleted, with one warning."""
    for folder in cache_root.folders(kind):
        path = os.path.join(folder, name)
        data, problem = _read_own(path)
        if data is None:
            if problem is not None:
                _damaged(path, problem, "compiling it again")
            continue
        problem = _seal_problem_of(data, key)
        if problem is None:
            return data[:-_SEAL_SIZE]
        _damaged(path, problem, "compiling it again")
    return None


def write_sealed(kind: str, name: str, key: str, data: bytes) -> str:
    """Write entry `kind/name` holding `data`, sealed for `key` (read back by `read_sealed`)."""
    sealed = data + SEAL + _digest(data, key)
    return _write_entry(kind, name, lambda tmp: _write_bytes(tmp, sealed), mode=0o666)


# -- compiled Python -----------------------------------------------------------
def compiled_code(source: str, filename: str) -> types.CodeType:
    """`compile(source, filename, "exec")`, kept as a sealed entry of kind "code": generated
    modules (a wrapper, Triton kernels) compile once per machine, whether or not Python may
    write .pyc files (PYTHONDONTWRITEBYTECODE); densenet121's wrapper alone took ~40 ms."""
    key = content_hash(CODE_FORMAT, importlib.util.MAGIC_NUMBER.hex(), filename, source)
    data = read_sealed("code", f"c{key}.bin", key)
    if data is not None:
        try:
            return marshal.loads(data)
        except (EOFError, ValueError, TypeError):  # (a sound seal over bytes marshal refuses: written by a bug)
            pass
    code = compile(source, filename, "exec")
    try:
        write_sealed("code", f"c{key}.bin", key, marshal.dumps(code))
    except OSError:  # (a full or read-only cache: compiled again next time)
        pass
    return code


# -- checks --------------------------------------------------------------------
class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


_MISSING = _Missing()
_damage_lock = threading.Lock()
_damage_seen: set[str] = set()


def _read_own(path: str) -> tuple[bytes | None, str | None]:
    """(the bytes of `path`, None) where it is there, readable and its owner trusted;
    else (None, why not), and (None, None) where it is missing."""
    try:
        with open(path, "rb") as f:
            owner = os.fstat(f.fileno()).st_uid
            if not cache_root.trusted_owner(owner):
                return None, f"belongs to another user (uid {owner})"
            return f.read(), None
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"


def _seal_problem(path: str, key: str) -> str | _Missing | None:
    """None if library `path` is sealed for `key`; _MISSING; else what is wrong with it."""
    data, problem = _read_own(path)
    if data is None:
        return problem if problem is not None else _MISSING
    return _seal_problem_of(data, key)


def _seal_problem_of(data: bytes, key: str) -> str | None:
    """None if `data` ends in a seal of its body for `key`; else what is wrong with it."""
    body, seal = data[:-_SEAL_SIZE], data[-_SEAL_SIZE:]
    if len(data) < _SEAL_SIZE or not seal.startswith(SEAL):
        return f"is damaged: it has no seal ({len(data)} bytes: truncated, or not written by torchweld)"
    if seal[len(SEAL):] != _digest(body, key):
        return "is damaged: its seal does not match its bytes and name (truncated, altered, or another entry's file)"
    return None


def _seal(path: str, key: str) -> None:
    with open(path, "rb") as f:
        body = f.read()
    with open(path, "ab") as f:
        f.write(SEAL + _digest(body, key))


def _digest(body: bytes, key: str) -> bytes:
    return hashlib.sha256(body + b"\0" + key.encode()).digest()


def _damaged(path: str, problem: str, action: str) -> None:
    """Say once what is wrong with entry `path` ("is damaged: ...", "belongs to another
    user ..."), and delete it (where the folder allows)."""
    with _damage_lock:
        first = path not in _damage_seen
        _damage_seen.add(path)
    if first:
        cache_root.log().warning("torchweld: the cache entry %s %s; %s", path, problem, action)
    try:
        os.unlink(path)
    except OSError:
        pass  # gone already, or a read-only cache: the new entry goes elsewhere


# -- writing -------------------------------------------------------------------
def _write_entry(kind: str, name: str, fill: Callable[[str], None], mode: int) -> str:
    """Write entry `kind/name` through `fill(temporary path)` and rename it into place, in
    the folder cache_root names: the configured directory's, or, where that refuses the
    write, the private one's. Errors of `fill` other than OSError are the caller's."""
    for _ in range(3):  # the configured folder, made again if deleted, then the private one
        folder = cache_root.writable_folder(kind)
        try:
            return _write_atomically(os.path.join(folder, name), fill, mode)
        except OSError as e:
            if not cache_root.refused(folder, e):
                raise
    return _write_atomically(os.path.join(cache_root.writable_folder(kind), name), fill, mode)


def _write_atomically(path: str, fill: Callable[[str], None], mode: int) -> str:
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    try:
        fill(tmp)
        os.chmod(tmp, mode & ~_umask())  # as an ordinary file: shareable where the umask allows
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


_umask_value: list[int] = []


def _umask() -> int:
    """The process's umask (read without setting it where Linux tells it: threads write files)."""
    if not _umask_value:
        try:
            with open("/proc/self/status") as f:
                line = next(line for line in f if line.startswith("Umask:"))
            _umask_value.append(int(line.split()[1], 8))
        except (OSError, StopIteration, ValueError, IndexError):
            old = os.umask(0o022)
            os.umask(old)
            _umask_value.append(old)
    return _umask_value[0]
