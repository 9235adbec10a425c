"""fake_memo's results over static sizes, kept on disk from one process to the next.

A warm start (a second process, the graph cache filled by the first) still captures the
model: every op runs on fake tensors to learn its result's metadata. In a fresh process
fake_memo knows none of them, and each first sight goes through FakeTensorMode: ~1 ms an
op on the H200 host, ~0.4 s of densenet121's 1.4 s warm start. What fake_memo remembers
depends on nothing but the op, its arguments' metadata and torch's own code (the file is
named by torch's version and the backend settings a meta function reads), so the results
a process learned (with those it read) are written beside the graph cache's entries after
each capture that added some, and the next process reads them before its first capture:

    fake_memo_disk.load()   # once per process, before its first capture
    fake_memo_disk.save()   # after a capture; writes only where results were added

Both run only with the graph cache on (config.graph_cache), and neither ever fails a
compile: a damaged file (its seal checks it) is deleted with a warning, an op this torch
does not have is skipped, and a write the cache folder refuses is logged and dropped.
Processes writing at once each write their whole table; the last one stays (results the
other learned meanwhile are learned again by a later process: a cost, never a wrong shape).
"""
from __future__ import annotations

import logging
import pickle
import sys
import threading

import torch

from torchweld import config, disk_cache, fake_memo

log = logging.getLogger("torchweld.cache")

FORMAT = "fake-results-2"  # changes with the layout of fake_memo's keys and results
KIND = "fake_results"
# Past this many results the file holds only those the last process learned (what it compiled),
# not those it read, so that a cache many models filled stays cheap to read at each start
# (densenet121 learns ~1500; 20000 synthetic ones unpickled in ~10 ms on the development CPU).
_MAX_ENTRIES = 20_000
_lock = threading.Lock()
_loaded = False


def _file_key() -> str:
    """What the remembered results rest on besides an op's arguments: torch's code and the
    settings its meta functions read (a convolution's output layout reads cudnn's and
    oneDNN's switches)."""
    backends = torch.backends
    return disk_cache.content_hash(FORMAT, sys.version, torch.__version__, str(torch.version.git_version),
                                   str(torch.version.cuda), repr((backends.cudnn.enabled, backends.mkldnn.enabled,
                                                                  torch.are_deterministic_algorithms_enabled())))


def load() -> None:
    """Add the results kept on disk to fake_memo's, once per process (graph cache on)."""
    global _loaded
    if _loaded or not config.graph_cache:
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        try:
            entries = _read(_file_key())
            added = fake_memo.absorb(entries)
        except Exception as e:  # noqa: BLE001 - a cache never fails a compile
            log.warning("torchweld: the fake results in the cache could not be read (%s: %s); ignoring them",
                        type(e).__name__, e)
            return
        log.debug("fake results: %d of %d loaded from disk", added, len(entries))


def save() -> None:
    """Write fake_memo's results over static sizes to disk (those this process read from the
    file and those it learned), where it remembered results since it last did (graph cache
    on). Two processes writing at once: the last one's file stays, each whole."""
    if not config.graph_cache or not fake_memo.unsaved():
        return
    with _lock:
        try:
            key = _file_key()
            entries = fake_memo.export()
            if len(entries) > _MAX_ENTRIES:
                entries = fake_memo.export(learned_only=True)
            if len(entries) > _MAX_ENTRIES:
                return
            disk_cache.write_sealed(KIND, _name(key), key, pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001 - a full disk, an unpicklable value: never a failed compile
            log.warning("torchweld: the fake results could not be written to the cache (%s: %s)",
                        type(e).__name__, e)
            return
        log.debug("fake results: %d written to disk", len(entries))


def _read(key: str) -> dict:
    """The results in the file for `key` ({} where there is none or it cannot be read)."""
    data = disk_cache.read_sealed(KIND, _name(key), key)
    if data is None:
        return {}
    try:
        entries = pickle.loads(data)
        if isinstance(entries, dict):
            return entries
        problem = f"holds a {type(entries).__name__}, not a dict"
    except Exception as e:  # noqa: BLE001 - sealed, so written by a torchweld that pickled otherwise
        problem = f"does not unpickle ({type(e).__name__}: {e})"
    log.warning("torchweld: the fake results file of the cache %s; ignoring it", problem)
    return {}


def _name(key: str) -> str:
    return f"f{key}.pickle"
