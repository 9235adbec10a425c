"""`with ddp.no_sync():` inside a compiled function (capture/ddp.py): the flag DDP reads is set
as a side effect replayed before each DDP call in the block, and restored on leaving it, to
the value found on entering (also at a graph break inside the block). 2 ranks on gloo."""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from gloo_ranks import on_two_ranks, requires_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

import torchweld

pytestmark = requires_gloo


def micro_step(model, x, sync):
    if sync:
        loss = model(x).pow(2).mean()
    else:
        with model.no_sync():
            loss = model(x).pow(2).mean()
            loss.backward()
        return loss
    loss.backward()
    return loss


def accumulate(model, xs):
    with model.no_sync():
        for x in xs[:-1]:
            model(x).pow(2).mean().backward()
    model(xs[-1]).pow(2).mean().backward()


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(rank: int) -> dict:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    models = [copy.deepcopy(base) for _ in range(3)]
    eager, per_micro, whole = (DDP(m) for m in models)
    compiled_micro = torchweld.compile(micro_step, backend="eager")
    compiled_accumulate = torchweld.compile(accumulate, backend="eager")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    torch.manual_seed(rank + 1)
    diffs, flags = [], []
    for _ in range(3):
        xs = [torch.randn(4, 8) for _ in range(3)]
        accumulate(eager, xs)
        for i, x in enumerate(xs):
            compiled_micro(per_micro, x, i == len(xs) - 1)
            flags.append(per_micro.require_backward_grad_sync)
        compiled_accumulate(whole, xs)
        flags.append(whole.require_backward_grad_sync)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        diffs.append([float((_params(models[0]) - _params(m)).abs().max()) for m in models[1:]])
    # entered while an eager no_sync() holds the flag False: left False, and no all-reduce
    with per_micro.no_sync():
        compiled_micro(per_micro, xs[0], False)
        inside = per_micro.require_backward_grad_sync
    # a no_sync of its own set on the instance after compiling: called, as eager calls it
    entered = []

    @contextlib.contextmanager
    def logged_no_sync():
        entered.append("enter")
        yield
        entered.append("exit")

    whole.no_sync = logged_no_sync
    compiled_accumulate(whole, xs)
    del whole.no_sync
    gathered = [torch.zeros_like(_params(models[1])) for _ in range(2)]
    grads = torch.cat([p.grad.flatten() for p in models[1].parameters()])
    torch.distributed.all_gather(gathered, grads)
    return {"diffs": diffs, "flags": flags, "inside": inside, "after": per_micro.require_backward_grad_sync,
            "grads_differ": bool((gathered[0] != gathered[1]).any()), "entered": entered}


def test_no_sync_inside_compiled_functions_accumulates_as_eager():
    for outcome in on_two_ranks(train):
        assert all(d == [0.0, 0.0] for d in outcome["diffs"]), outcome
        assert all(outcome["flags"]) and outcome["after"] is True, outcome
        assert outcome["inside"] is False, outcome
        assert outcome["grads_differ"], outcome  # each rank kept its own gradients: not all-reduced
        assert outcome["entered"] == ["enter", "exit"], outcome
