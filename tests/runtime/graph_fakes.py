"""A CPU stand-in for CudaGraphRecorder: "recording" runs the function once and
keeps its results as the static outputs; each replay runs it again on the static
inputs and overwrites those outputs in place, as a CUDA graph replay does."""
from __future__ import annotations

import torch


class FakeRecorder:
    replays_by_address = False  # a replay runs the function again, on the arguments bound for it

    def __init__(self, device_type: str = "cpu", fail_with: Exception | None = None):
        self.device_type = device_type
        self.fail_with = fail_with
        self.pools: list[object] = []
        self.records: list[object] = []  # the pool of each recording
        self.warm_ups = 0
        self.replays = 0

    def new_pool(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def warm_up(self, fn, device):
        self.warm_ups += 1
        return fn()

    def record(self, fn, pool, device):
        if self.fail_with is not None:
            raise self.fail_with
        static = list(fn())
        self.records.append(pool)

        def replay():
            self.replays += 1
            for out, new in zip(static, fn()):
                if isinstance(out, torch.Tensor):
                    out.copy_(new)

        return replay, static
