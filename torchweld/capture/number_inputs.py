"""Python numbers that a graph takes as tensors, so that a new value is not a new graph.

An optimizer's learning rate is a float in its param group that schedulers change
every step or epoch. Captured as a constant, each new value would fail the guards
and recompile the step. Instead the captured step reads it as a 0-d float64 tensor
(`NumberTensor`) on the parameters' device, which the entry function refills in place
when the number changed: `fill_` with a Python scalar queues a kernel, no copy from
the host and no synchronization. float64 keeps Python's arithmetic on the number
(`1 - lr * weight_decay`) before the operation that uses it casts it, as eager does.

Only a number that capture itself never computes with stays unguarded: the first
use as a constant (`lr * 2` in user code, a print) guards its value as usual
(`values.GuardedOnUseNumber`).
"""
from __future__ import annotations

import torch


class NumberTensor:
    """One 0-d float64 tensor on a device, standing for a Python number."""

    def __init__(self, value: float, device: torch.device):
        self.value = value
        self.tensor = torch.tensor(value, dtype=torch.float64, device=device)

    def __call__(self, value: float) -> torch.Tensor:
        if value != self.value:  # on the stream, before the graph that reads it
            self.tensor.fill_(value)
            self.value = value
        return self.tensor
