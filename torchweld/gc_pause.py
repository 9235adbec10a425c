"""Python's cyclic garbage collector held off while torchweld compiles.

Capture, tracing to aten and lowering make hundreds of thousands of objects
(FX nodes, fake tensors, loop-IR expressions), and each collection their
allocations set off walks the whole young heap again, and each full one the
whole program's: a 12-layer GPT-2's lowering on the CPU took 1.05 s with the
collector running and 0.47 s without (its whole cold first step 8.0 s and 7.3).
In a process whose heap is large already, each full collection costs more:
resnet50's backward, compiled in a thread of its own after capture had turned
the collector back on, rendered in 2.1 s instead of 0.9 s after torch.compile
had run in the same process.

The pause is counted across threads: the collector is off while any compile
(capture, the backward's compile in its thread) holds it, and back on, if it
was on before the first, once the last is done. Cycles made meanwhile are
collected then."""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_holders = 0
_enable_after = False  # whether the collector was on when the first holder paused it


@contextlib.contextmanager
def paused():
    global _holders, _enable_after
    with _lock:
        if _holders == 0:
            _enable_after = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _enable_after:
                gc.enable()
