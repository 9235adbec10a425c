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

from typing import Callable

import torch


class NumberTensor:
    """One 0-d tensor holding `compute(number)` for a Python number read at each call."""

    def __init__(self, value: float, device: torch.device, dtype: torch.dtype,
                 compute: Callable[[float], float] | None = None):
        self.compute = compute or (lambda x: x)
        self.value = value
        self.tensor = torch.tensor(self.compute(value), dtype=dtype, device=device)

    def __call__(self, value: float) -> torch.Tensor:
        if value != self.value:  # queued on the stream, before the graph that reads it
            self.tensor.fill_(self.compute(value))
            self.value = value
        return self.tensor
