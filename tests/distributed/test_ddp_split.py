"""A graph captured inside DDP's forward is split at DDP's gradient buckets (capture/ddp_split.py):
each piece's backward is its own autograd node, so a bucket's all-reduce starts before the
backward of the earlier pieces has run. 2 ranks on gloo, both wrapping orders."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from gloo_ranks import on_two_ranks, requires_gloo
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import torchweld
from torchweld.capture.ddp_split import META_KEY
from torchweld.capture.report import collecting

pytestmark = requires_gloo

LAYER_BYTES = (64 * 64 + 64) * 4
BUCKET_CAP_MB = 15000 / 2**20  # below one layer's parameters: one bucket per layer


class Deep(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.checkpointed = checkpointed

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
            x = torch.tanh(x)
        return x


def _wrap(model: nn.Module, order: str, backend: str) -> nn.Module:
    if order == "outer":
        return torchweld.compile(DDP(model, bucket_cap_mb=BUCKET_CAP_MB), backend=backend)
    return DDP(torchweld.compile(model, backend=backend), bucket_cap_mb=BUCKET_CAP_MB)


def record_overlap(rank: int, order: str, backend: str, checkpointed: bool = False) -> dict:
    """Train 3 steps, compiled and eager; at each bucket's all-reduce, note whether the first
    layer's gradient exists yet (the backward of the first piece, which makes it, runs last)."""
    torch.manual_seed(0)
    base = Deep(checkpointed)
    eager_model, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    reference = DDP(eager_model, bucket_cap_mb=BUCKET_CAP_MB)
    compiled = _wrap(compiled_model, order, backend)
    events = []

    def hook(state, bucket):
        events.append((bucket.index(), compiled_model.layers[0].weight.grad is not None))
        work = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    compiled.register_comm_hook(None, hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_model, compiled_model)]
    torch.manual_seed(rank + 1)
    diffs, steps = [], []
    with collecting() as reports:
        for _ in range(3):
            x = torch.randn(8, 64)
            for model, optimizer in zip((reference, compiled), optimizers):
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            diffs.append(max(float((a - b).detach().abs().max()) for a, b in zip(eager_model.parameters(), compiled_model.parameters())))
            steps.append(list(events))
            events.clear()
    splits = [r.graph.meta.get(META_KEY) for r in reports if r.graph is not None]
    return {"diffs": diffs, "steps": steps, "pieces": [s.pieces if s else 1 for s in splits],
            "piece_bytes": [s.piece_param_bytes for s in splits if s]}


# (wrapping order, backend, layers under activation checkpointing: pieces still a layer each)
CASES = [("outer", "eager", False), ("inner", "eager", False), ("outer", "weld", False), ("inner", "weld", False),
         ("outer", "eager", True), ("outer", "weld", True)]


def record_all(rank: int) -> list:
    return [record_overlap(rank, *case) for case in CASES] + [explain_split(rank), dynamic_pieces(rank)]


def dynamic_pieces(rank: int) -> list[int]:
    """Pieces of the graphs of a model compiled with dynamic=True: symbolic sizes, not split."""
    compiled = torchweld.compile(DDP(Deep(), bucket_cap_mb=BUCKET_CAP_MB), backend="eager", dynamic=True)
    with collecting() as reports:
        for batch in (8, 6):
            compiled(torch.randn(batch, 64)).sum().backward()
    return [getattr(r.graph.meta.get(META_KEY), "pieces", 1) for r in reports if r.graph is not None]


@pytest.fixture(scope="module")
def outcomes():
    per_rank = on_two_ranks(record_all)
    return [[rank[i] for rank in per_rank] for i in range(len(CASES) + 2)]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c[:2]) + ("-checkpointed" if c[2] else "") for c in CASES])
def test_split_at_buckets_starts_an_all_reduce_before_the_backward_ends(outcomes, case):
    order, backend, _ = case
    for outcome in outcomes[CASES.index(case)]:
        assert max(outcome["diffs"]) <= (0.0 if backend == "eager" else 1e-5), outcome
        assert outcome["pieces"] == [4], outcome  # one graph, one piece per bucket (per layer)
        assert outcome["piece_bytes"] == [(LAYER_BYTES,) * 4], outcome
        first, *later = outcome["steps"]
        assert len(first) == 1, first  # DDP's first step: one bucket; it rebuilds them after it
        for events in later:
            # one all-reduce per bucket as DDP rebuilt them from the order gradients came (4; 5 where a
            # layer's weight gradient came before its bias's and filled a bucket alone)
            assert len(events) >= 4, events
            # the first all-reduce launched before the first layer's gradient was made: before
            # the backward of the first piece (the last to run) ran
            assert events[0][1] is False, events
            assert events[-1][1] is True, events


def explain_split(rank: int) -> str:
    torch.manual_seed(0)
    ddp = DDP(Deep(), bucket_cap_mb=BUCKET_CAP_MB)
    output = torchweld.explain(ddp)(torch.randn(8, 64))
    assert output.pieces_per_graph == [4], output.pieces_per_graph
    return str(output)


def test_explain_says_how_many_pieces_and_why(outcomes):
    text = outcomes[-2][0]
    assert "Graph 1: split into 4 pieces at DistributedDataParallel's gradient buckets" in text, text
    assert f"parameters per piece: {LAYER_BYTES} B, {LAYER_BYTES} B" in text, text


def test_a_graph_outside_ddp_is_not_split():
    model = Deep()
    output = torchweld.explain(model)(torch.randn(8, 64))
    assert output.pieces_per_graph == [1] and "split" not in str(output)


def test_a_graph_with_symbolic_sizes_is_compiled_whole(outcomes):
    """Pieces compiled from one call's tensors would hold its sizes (capture/ddp_split.py)."""
    assert outcomes[-1][0] == [1], outcomes[-1]
