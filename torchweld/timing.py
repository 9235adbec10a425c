"""Where compile time goes: wall seconds per phase, summed over the process.

    with timing.phase("weld.lower"):
        ...
    torchweld.compile_times()                # {phase: total seconds}
    print(torchweld.compile_times("str"))    # one row per phase: calls, total seconds

Phases nest (the backend's time includes lowering's); each row is inclusive
of the phases inside it. A training graph's backward compiles in a background thread
while its forward compiles (autograd/training.py): its phases overlap the forward's,
outside `backend`. Rows named `.threads.` or `.workers.` sum the time of work
done in parallel (one call per kernel), so they add up to more than wall time. `TORCHWELD_LOGS=compile_times` logs, after each
frame is compiled, the phases that frame spent time in. `TORCHWELD_COMPILE_TRACE=file.json`
(config.compile_trace) writes every phase with its thread and start as a Chrome trace at exit.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import threading
import time
from typing import Iterator

from torchweld import config, logs

_lock = threading.Lock()
_totals: dict[str, list] = {}  # phase -> [calls, seconds], in the order phases were first seen
_events: list[tuple[str, str, float, float, str | None]] = []  # (phase, thread, start, seconds, detail) while config.compile_trace


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    with _lock:
        _totals.setdefault(name, [0, 0.0])  # rows in the order phases start: outer before inner
    start = time.perf_counter()
    try:
        yield
    finally:
        record(name, time.perf_counter() - start)


def record(name: str, seconds: float, detail: str | None = None) -> None:
    """Add one call of `seconds`, ending now, to phase `name` (also for time measured
    elsewhere, in a worker process); `detail` (what the call worked on, a kernel's name)
    goes into the compile trace alone."""
    with _lock:
        row = _totals.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += seconds
        if config.compile_trace:
            _events.append((name, threading.current_thread().name, time.perf_counter() - seconds, seconds, detail))


def write_trace(path: str | None = None) -> None:
    """The phases recorded so far as a Chrome trace (complete events, microseconds), into
    `path` or config.compile_trace (nothing where both are empty)."""
    path = path or config.compile_trace
    if not path:
        return
    with _lock:
        events = list(_events)
    origin = min((event[2] for event in events), default=0.0)
    threads = {thread: i for i, thread in enumerate(dict.fromkeys(event[1] for event in events))}
    trace = [{"name": name, "ph": "X", "pid": 0, "tid": threads[thread], "ts": (start - origin) * 1e6,
              "dur": seconds * 1e6, **({"args": {"detail": detail}} if detail else {})}
             for name, thread, start, seconds, detail in events]
    trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": thread}}
              for thread, i in threads.items()]
    with open(path, "w") as f:
        json.dump({"traceEvents": trace}, f)


atexit.register(write_trace)  # writes nothing unless config.compile_trace names a file


def snapshot() -> dict[str, tuple[int, float]]:
    """{phase: (calls, seconds)} so far in this process."""
    with _lock:
        return {name: (calls, seconds) for name, (calls, seconds) in _totals.items()}


def since(before: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    """The phases that ran after `before` (a snapshot), with their calls and seconds since."""
    out = {}
    for name, (calls, seconds) in snapshot().items():
        calls0, seconds0 = before.get(name, (0, 0.0))
        if calls > calls0:
            out[name] = (calls - calls0, seconds - seconds0)
    return out


def table(times: dict[str, tuple[int, float]] | None = None) -> str:
    """`times` (default: the whole process so far) as aligned rows: phase, calls, seconds."""
    times = snapshot() if times is None else times
    if not times:
        return "no compile has run yet"
    width = max(len(name) for name in times)
    lines = [f"{'phase':{width}}  calls  seconds"]
    lines += [f"{name:{width}}  {calls:5d}  {seconds:7.3f}" for name, (calls, seconds) in times.items()]
    return "\n".join(lines)


def compile_times(repr: str = "dict", aggregate: bool = True) -> dict[str, float] | str | tuple[list[str], list[str]]:
    """Where compile time went in this process: `torchweld.compile_times()`.

    repr="dict" (the default): {phase: total seconds}; "str": a table of phase, calls and
    seconds; "csv": (phases, seconds as text), the form torch.compile's compile_times(repr="csv") gives.
    torchweld keeps each phase's total, not each call's: `aggregate` (torch's, which sums a
    phase's calls when True) is accepted for the same signature, and sums either way."""
    times = snapshot()
    if repr == "dict":
        return {name: seconds for name, (_, seconds) in times.items()}
    if repr == "str":
        return table(times)
    if repr == "csv":
        return list(times), [f"{seconds:.6f}" for _, seconds in times.values()]
    raise ValueError(f"compile_times: repr must be 'dict', 'str' or 'csv', not {repr!r}")


def log_frame(function: str, before: dict[str, tuple[int, float]]) -> None:
    """Log (artifact compile_times) what compiling `function` spent, phase by phase."""
    log = logs.get("compile_times")
    if log.isEnabledFor(logging.INFO):
        parts = ", ".join(f"{name} {seconds:.3f} s" for name, (_, seconds) in since(before).items())
        log.info("compiling %s: %s", function, parts)


def reset() -> None:
    with _lock:
        _totals.clear()
        _events.clear()
