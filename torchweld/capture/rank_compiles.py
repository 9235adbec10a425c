"""Compiles compared across the ranks of a torch.distributed job.

Every rank should compile the same graphs in the same order: a rank whose guard fails alone
compiles while the others wait at their next collective, and ranks whose graphs differ run
different code. No compiled graph holds a collective here (each is a graph break of kind
`distributed`, capture/handlers), so a rank compiling alone delays the others but cannot
leave them waiting forever inside a graph; what this module adds is saying so.

Each translation of a frame on each rank is written into the default process group's store
under its number on that rank (`torchweld/compiles/<generation>/<n>/<rank>`: what was
compiled, where, a digest of the graph). A rank that writes its n-th compile reads the
n-th of every rank that wrote one before it (the store's `check`, no waiting), and where they
differ it warns once per process and logs each difference under `recompiles`, naming both
ranks' functions, lines and graphs: the later of two ranks reports. Nothing is written
outside a distributed job, and a store that cannot be reached is left alone (a log line).
`torchweld.reset()` starts a new generation, so ranks that reset together compare afresh.
"""
from __future__ import annotations

import hashlib
import itertools
import re
import warnings

import torch

from torchweld import logs
from torchweld.capture.report import TranslationReport

_PREFIX = "torchweld/compiles"
_state = {"generation": 0, "count": itertools.count(1), "warned": False}


def forget() -> None:
    """A new generation of numbers (torchweld.reset())."""
    _state["generation"] += 1
    _state["count"] = itertools.count(1)


# a device's index in a graph's code (`device(type='cuda', index=1)`, 'cuda:1'): each rank has
# its own GPU, so graphs that make tensors on their rank's device differ only there
_DEVICE_INDEX = re.compile(r"(index=|\b(?:cuda|xpu|hpu|mps):)\d+")


def describe(code, report: TranslationReport) -> str:
    """What this translation compiled, the same text on every rank that compiled the same
    (device indices left out)."""
    where = f"{report.function} at {code.co_filename}:{code.co_firstlineno}"
    if report.graph is None:
        what = "no graph" if report.break_reason is None else f"no graph ({report.break_reason.reason})"
    else:
        text = _DEVICE_INDEX.sub(r"\1N", report.graph.code)
        what = f"a graph of {report.op_count} ops ({hashlib.sha256(text.encode()).hexdigest()[:12]})"
    return f"{where}: {what}"


def _job():
    """(store, rank, world size) of the default process group, or None outside a job."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # a process group made without a store
        return None
    return store, dist.get_rank(), dist.get_world_size()


def note(code, report: TranslationReport) -> None:
    """Write this rank's translation of `code` and compare it with the other ranks' of that number."""
    job = _job()
    if job is None:
        return
    store, rank, world = job
    n = next(_state["count"])
    key = f"{_PREFIX}/{_state['generation']}/{n}"
    mine = describe(code, report)
    try:
        store.set(f"{key}/{rank}", mine)
        theirs = {other: store.get(f"{key}/{other}").decode() for other in range(world)
                  if other != rank and store.check([f"{key}/{other}"])}
    except Exception as e:  # the store went away (a job ending): compiling goes on
        logs.get("recompiles").info("compiles not compared across ranks (%s: %s)", type(e).__name__, e)
        return
    for other, text in sorted(theirs.items()):
        if text != mine:
            _report(n, rank, mine, other, text)


def _report(n: int, rank: int, mine: str, other: int, theirs: str) -> None:
    message = (f"torchweld: ranks compiled different graphs: compile {n} of rank {rank} is {mine}; "
               f"rank {other}'s is {theirs}. Ranks that take other paths through the program (a guard "
               f"failing on one rank, code that depends on the rank) compile apart; the others wait "
               f"at their next collective while one compiles (no compiled graph holds a collective)")
    logs.get("recompiles").info("%s", message)
    if not _state["warned"]:
        _state["warned"] = True
        warnings.warn(message + ". Further differences: TORCHWELD_LOGS=recompiles", stacklevel=2)
