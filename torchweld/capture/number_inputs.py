"""Python numbers that a graph takes as tensors, so that a new value is not a new graph.

An optimizer's learning rate is a float in its param group that schedulers change
every step or epoch (and OneCycleLR changes Adam's beta1 with it). Captured as a constant, each new value would fail the guards
and recompile the step. Instead the captured step reads it as a 0-d tensor
(`NumberTensor`) on the parameters' device, which the entry function refills in place
when the number changed: `fill_` with a Python scalar queues a kernel, no copy from
the host and no synchronization.

What the graph needs is sometimes a function of the number (`1 - lr * weight_decay`,
by which AdamW scales its parameters): the holder computes it on the host, in
Python's double precision as eager does, and stores it in the dtype of the tensors
it scales, so that the graph's arithmetic is eager's (a scalar argument is cast to
that dtype too, for float32 and float64 tensors).

Only a number that capture itself never computes with stays unguarded: the first
use as a constant (`lr * 2` in user code, a print) guards its value as usual
(`values.GuardedOnUseNumber`).
"""
from __future__ import annotations

import math
import threading
from typing import Callable

import torch


class NumberTensor:
    """One 0-d tensor holding `compute(number)` for a Python number read at each call; one
    per thread, so that threads calling one compiled function with different numbers do not
    refill each other's tensor between a fill and the graph that reads it."""

    def __init__(self, value: float, device: torch.device, dtype: torch.dtype,
                 compute: Callable[[float], float] | None = None):
        self.compute = compute or (lambda x: x)
        self.device, self.dtype = device, dtype
        self.value = value
        self.tensor = torch.tensor(self.compute(value), dtype=dtype, device=device)
        self._thread = threading.get_ident()  # the thread that holds `tensor`
        self._others = threading.local()  # every other thread's (value, tensor)

    def __call__(self, value: float) -> torch.Tensor:
        if threading.get_ident() != self._thread:
            return self._in_another_thread(value)
        if not _same(value, self.value):  # queued on the stream, before the graph that reads it
            self.tensor.fill_(self.compute(value))
            self.value = value
        return self.tensor

    def _in_another_thread(self, value: float) -> torch.Tensor:
        held = getattr(self._others, "held", None)
        if held is None:
            held = self._others.held = [value, torch.tensor(self.compute(value), dtype=self.dtype, device=self.device)]
        elif not _same(value, held[0]):
            held[1].fill_(self.compute(value))
            held[0] = value
        return held[1]


def _same(a: float, b: float) -> bool:
    """The same number to a graph: -0.0 is not 0.0 (x * -0.0 is -0.0 where x > 0), and NaN is
    never the same (it is refilled, which costs nothing it would not)."""
    return a == b and (a != 0 or math.copysign(1.0, a) == math.copysign(1.0, b))
