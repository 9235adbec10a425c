"""Traced aten graphs run with torch.autocast off.

Tracing a graph under `torch.autocast` writes autocast's casts into the aten graph (a matmul
on bfloat16 copies of its inputs; an op autocast keeps in float32, such as the CPU's attention
math, on float32 ones). Run again under the user's autocast, the graph's extern calls would be
cast a second time: `aten.bmm` of two float32 tensors the trace kept in float32 returns
bfloat16, half the bytes the kernels after it read (a crash in a C++ kernel reading past the
end, or wrong values). AOTAutograd runs its compiled graphs the same way.
"""
from __future__ import annotations

import contextlib

import torch


def autocast_off():
    """A context where autocast is off, for as long as it is on in this thread; else nothing to do."""
    if torch._C._is_any_autocast_enabled():
        return torch._C._DisableAutocast()
    return contextlib.nullcontext()


def run_without_autocast(fn, *args):
    """`fn(*args)` with autocast off: a traced graph's call. On the per-call path, one check
    where autocast is off (no context object)."""
    if torch._C._is_any_autocast_enabled():
        with torch._C._DisableAutocast():
            return fn(*args)
    return fn(*args)
