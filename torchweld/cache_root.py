"""Which directories hold torchweld's disk cache in this process: `config.cache_dir`
where it can be used, and a private temporary directory where it cannot.

    for folder in folders("cpp"):         # the configured directory's first, then the private one's
        ...                               # look for an entry there
    folder = writable_folder("cpp")       # where a new entry goes; if writing there fails:
    refused(folder, error)                # True: try again (writable_folder may name another folder)

The configured directory ("" means the default, ~/.cache/torchweld) is used where it
exists or can be made, and belongs to this user (or `config.cache_trust_other_users`
is set). Otherwise, and from the first write it refuses (read-only, another user's,
deleted and not to be made again), entries are written to a directory made with
`tempfile.mkdtemp` for this process and removed at its exit; one warning says why.
Entries already in a directory that refuses writes are still read from it.
"""
from __future__ import annotations

import atexit
import dataclasses
import errno
import os
import shutil
import tempfile
import threading

from torchweld import config, logs

DEFAULT = "~/.cache/torchweld"

_lock = threading.Lock()
_places: dict[str, "_Place"] = {}  # config.cache_dir value -> what this process found there
_private: list[str] = []  # the private directory, once made (one per process)
_made: set[str] = set()  # folders made by this process (a system call less per entry)
_warned: set[tuple] = set()  # what this process has warned about, once each


@dataclasses.dataclass
class _Place:
    """One `config.cache_dir` value as this process found it."""

    root: str | None  # the directory, or None where it cannot be used at all
    writable: bool  # False once a write there failed: new entries go to the private directory


def log():
    return logs.get("cache")


def configured_root() -> str | None:
    """The configured cache directory, made if missing; None (with one warning) where it
    cannot be used, and entries then live in the private directory."""
    return _place().root


def folders(kind: str) -> list[str]:
    """The folders to look for an entry of `kind` ("cpp", "guards", ...) in, in order: the
    configured directory's (where usable), the helpers directory's for a C helper, then the
    private directory's (once made)."""
    place = _place()
    found = [os.path.join(place.root, kind)] if place.root is not None else []
    helpers = _helpers_folder(kind)
    if helpers is not None and helpers not in found:
        found.append(helpers)
    if _private or place.root is None:
        found.append(os.path.join(private_root(), kind))
    for folder in found:
        _make(folder)
    return found


def writable_folder(kind: str) -> str:
    """Where a new entry of `kind` is written: a C helper's in the helpers directory where it
    can be used; else the configured directory's folder until a write there fails, then the
    private directory's."""
    helpers = _helpers_folder(kind)
    if helpers is not None:
        return helpers
    place = _place()
    root = place.root if place.root is not None and place.writable else private_root()
    folder = os.path.join(root, kind)
    _make(folder)
    return folder


HELPER_KINDS = frozenset({"guards", "launcher"})  # the C helpers, built once per machine (config.helpers_dir)
_unusable_helpers: set[str] = set()  # helpers folders a write refused: not tried again by this process


def _helpers_folder(kind: str) -> str | None:
    """The helpers directory's folder for a C helper `kind`, where it exists or can be made,
    is this user's and can be written; None otherwise (the helper then lives in cache_dir)."""
    if kind not in HELPER_KINDS:
        return None
    root = os.path.expanduser(config.helpers_dir)
    if root.startswith("~"):
        return None
    folder = os.path.join(os.path.abspath(root), kind)
    if folder in _unusable_helpers:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        usable = os.stat(folder).st_uid == os.geteuid() and os.access(folder, os.W_OK | os.X_OK)
    except OSError:
        usable = False
    if not usable:
        with _lock:
            _unusable_helpers.add(folder)
        return None
    return folder


def refused(folder: str, error: OSError) -> bool:
    """A write into `folder` failed with `error`; whether to try again (writable_folder may
    now name another folder). True where the folder had been deleted and is made again, or
    where the configured directory is given up for writes from now on (one warning: new
    entries go to the private directory); False where nothing else can be tried."""
    if os.path.basename(folder) in HELPER_KINDS and folder == _helpers_folder(os.path.basename(folder)):
        with _lock:  # the helpers directory refused: this process builds its helpers in cache_dir
            _unusable_helpers.add(folder)
        return True
    place = _place()
    configured = place.root is not None and _inside(folder, place.root)
    if error.errno == errno.ENOENT and _remake(folder):
        if configured:
            _warn_once(("deleted", place.root), "torchweld: the cache directory %s was deleted while this "
                       "process ran; made it again", place.root)
        return True
    if not configured:
        return False
    with _lock:
        place.writable = False
    _warn_once(("unwritable", place.root), "torchweld: cannot write to the cache directory %s (%s); this "
               "process keeps new compiled kernels in %s, removed at exit. Set TORCHWELD_CACHE_DIR to a "
               "writable directory to keep them between runs.", place.root, _why(error), private_root())
    return True


def private_root() -> str:
    """This process's own cache directory (tempfile.mkdtemp), made at first use, removed at exit."""
    with _lock:
        if not _private:
            path = tempfile.mkdtemp(prefix="torchweld-cache-")
            _private.append(path)
            atexit.register(shutil.rmtree, path, ignore_errors=True)
        return _private[0]


def trusted_owner(uid: int) -> bool:
    """Whether files owned by `uid` may be loaded: this user's, or anyone's where
    `config.cache_trust_other_users` says so."""
    return uid == os.geteuid() or config.cache_trust_other_users


def forget() -> None:
    """Look at `config.cache_dir` afresh at next use (tests)."""
    with _lock:
        _places.clear()
        _made.clear()
        _warned.clear()
        _unusable_helpers.clear()


# -- finding the configured directory --------------------------------------------
def _place() -> _Place:
    configured = config.cache_dir  # read at call time: tests patch it
    place = _places.get(configured)
    if place is None:
        root, problem = _usable(configured)
        with _lock:
            place = _places.setdefault(configured, _Place(root, root is not None))
        if problem is not None and place.root is None:
            _warn_once(("unusable", configured), "torchweld: %s; this process keeps its compiled kernels in "
                       "%s, removed at exit. Set TORCHWELD_CACHE_DIR to a directory of your own to keep "
                       "them between runs.", problem, private_root())
    return place


def _usable(configured: str) -> tuple[str | None, str | None]:
    """(the directory, None), or (None, why it cannot be used)."""
    path = os.path.expanduser(configured or DEFAULT)
    if path.startswith("~"):
        return None, f"no home directory for the default cache directory {DEFAULT} (HOME is unset)"
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        owner = os.stat(path).st_uid
    except OSError as e:
        return None, f"cannot use the cache directory {path} ({_why(e)})"
    if not trusted_owner(owner):
        return None, (f"the cache directory {path} belongs to another user (uid {owner}); torchweld loads "
                      "only its own user's files there unless TORCHWELD_CACHE_TRUST_OTHER_USERS=1")
    if not os.access(path, os.R_OK | os.X_OK):
        return None, f"cannot read the cache directory {path}"
    return path, None


def _make(folder: str) -> None:
    if folder in _made:
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return  # a read-only cache: its entries are still read; a write says so (refused)
    _made.add(folder)


def _remake(folder: str) -> bool:
    """Make `folder` again (deleted since this process made it); whether that worked."""
    _made.discard(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return False
    _made.add(folder)
    return True


def _inside(folder: str, root: str) -> bool:
    return os.path.commonpath([os.path.abspath(folder), root]) == root


def _warn_once(what: tuple, message: str, *args: object) -> None:
    with _lock:
        if what in _warned:
            return
        _warned.add(what)
    log().warning(message, *args)


def _why(error: OSError) -> str:
    return error.strerror or str(error)
