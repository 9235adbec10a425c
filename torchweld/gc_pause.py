"""Python's cyclic garbage collector held off while torchweld compiles.

Capture, tracing to aten and lowering make hundreds of thousands of objects
(FX nodes, fake tensors, loop-IR expressions), and each collection their
allocations set off walks the whole young heap again, and each full one the
whole program's: a 12-layer GPT-2's lowering on the CPU took 1.05 s with the
collector running and 0.47 s without (its whole cold first step 8.0 s and 7.3).
Cycles made meanwhile are collected once compiling is over. Nested and
concurrent compiles leave the collector to whichever turned it off."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
