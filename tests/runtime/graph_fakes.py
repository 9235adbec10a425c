"""A CPU stand-in for CudaGraphRecorder: "recording" runs the function once and
keeps its results as the static outputs; each replay runs it again on the static
inputs and overwrites those outputs in place, as a CUDA graph replay does."""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree


class FakeRecorder:
    replays_by_address = False  # a replay runs the function again, on the arguments bound for it

    def __init__(self, device_type: str = "cpu", fail_with: Exception | None = None):
        self.device_type = device_type
        self.fail_with = fail_with
        self.pools: list[object] = []
        self.records: list[object] = []  # the pool of each recording
        self.warm_ups = 0
        self.replays = 0
        self.warm_up_outputs: list[weakref.ref] = []  # the tensors each warm-up returned
        self.warm_up_outputs_alive: list[int] = []  # how many of them were alive at each recording

    def new_pool(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def warm_up(self, fn, device):
        self.warm_ups += 1
        out = fn()
        self.warm_up_outputs += [weakref.ref(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def record(self, fn, pool, device):
        if self.fail_with is not None:
            raise self.fail_with
        self.warm_up_outputs_alive.append(sum(ref() is not None for ref in self.warm_up_outputs))
        static = list(fn())
        self.records.append(pool)
        # as a CUDA graph holds no tensor: an output CudaGraphed lets go of is not kept alive here
        refs = [weakref.ref(t) if isinstance(t, torch.Tensor) else None for t in static]

        def replay():
            self.replays += 1
            for ref, new in zip(refs, fn()):
                out = ref() if ref is not None else None
                if out is not None:
                    out.copy_(new)

        return replay, static
