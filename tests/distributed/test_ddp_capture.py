"""torchweld.compile(DDP(model)): DDP's bookkeeping runs in Python each call, its module is
captured; gradients are all-reduced as eager DDP's (capture/ddp.py). 2 ranks on gloo."""
from __future__ import annotations

import pytest
from ddp_training import Run, train
from gloo_ranks import on_two_ranks, requires_gloo

pytestmark = requires_gloo

RUNS = {
    "sgd": Run(optimizer="sgd"),
    "adam": Run(optimizer="adam"),
    "transformer_adam": Run(model="transformer", optimizer="adam"),
    "no_sync_accumulation": Run(accumulate=3),
    "find_unused_parameters": Run(model="mlp_unused", ddp_options=(("find_unused_parameters", True),)),
    "static_graph": Run(ddp_options=(("static_graph", True),), steps=4),
    "weld_sgd": Run(backend="weld"),
    # DDP(torchweld.compile(model)); and graphs split at small buckets (capture/ddp_split.py)
    "inner_sgd": Run(order="inner"),
    "inner_weld_adam": Run(order="inner", backend="weld", optimizer="adam"),
    # (SGD: Adam turns weld's last-bit differences in near-zero gradients into differences of
    # 1e-4 after 3 steps, split or not)
    "split_transformer_weld": Run(model="transformer", backend="weld", ddp_options=(("bucket_cap_mb", 0.002),)),
    "split_inner_transformer_accumulation": Run(order="inner", model="transformer", accumulate=2,
                                                ddp_options=(("bucket_cap_mb", 0.002),)),
    "split_static_graph": Run(ddp_options=(("static_graph", True), ("bucket_cap_mb", 0.002)), steps=4),
    "split_find_unused_parameters": Run(order="inner", model="mlp_unused",
                                        ddp_options=(("find_unused_parameters", True), ("bucket_cap_mb", 0.002))),
    "split_convbn_weld": Run(model="convbn", backend="weld", ddp_options=(("bucket_cap_mb", 0.001),)),
    "split_dynamic_batch": Run(dynamic=True, ddp_options=(("bucket_cap_mb", 0.002),)),
    "split_dynamic_batch_weld": Run(order="inner", dynamic=True, backend="weld", ddp_options=(("bucket_cap_mb", 0.002),)),
    # a compiled function calling a DDP module: a graph break at the call, DDP's forward run through
    # capture/ddp.py (its module in a graph of its own), the loss after it in a resume function's graph
    "step_sgd": Run(order="step"),
    "step_weld_adam": Run(order="step", backend="weld", optimizer="adam"),
}


def compiled_ddp_surface(rank: int) -> dict:
    """What a user reads of torchweld.compile(DDP(model)): DDP's state_dict keys, its module,
    its methods, train/eval."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchweld
    from ddp_training import MLP

    ddp = DDP(MLP())
    compiled = torchweld.compile(ddp, backend="eager")
    compiled.eval()
    x = torch.randn(2, 8)
    same = bool(torch.equal(compiled(x), ddp(x)))
    return {"keys": list(compiled.state_dict()) == list(ddp.state_dict()), "module": compiled.module is ddp.module,
            "eval": not ddp.training and not ddp.module.fc1.training, "same": same,
            "no_sync": callable(compiled.no_sync)}


def train_and_inspect(rank: int, runs: list) -> tuple:
    return train(rank, runs), compiled_ddp_surface(rank)


@pytest.fixture(scope="module")
def launched():
    names = list(RUNS)
    per_rank = on_two_ranks(train_and_inspect, [RUNS[n] for n in names])
    outcomes = {name: [rank[0][i] for rank in per_rank] for i, name in enumerate(names)}
    return outcomes, [rank[1] for rank in per_rank]


@pytest.fixture(scope="module")
def outcomes(launched):
    return launched[0]


def test_compiled_ddp_reads_as_ddp(launched):
    for surface in launched[1]:
        assert all(surface.values()), surface


@pytest.mark.parametrize("name", list(RUNS))
def test_compiled_ddp_trains_as_eager_ddp(outcomes, name):
    for rank, outcome in enumerate(outcomes[name]):
        exact = RUNS[name].backend == "eager"
        limit = 0.0 if exact else 1e-5
        assert max(outcome.max_diff_per_step) <= limit, (rank, outcome)
        assert outcome.rank_spread == 0.0, (rank, outcome)
        if RUNS[name].order == "step":
            assert outcome.graphs == 2 and len(outcome.breaks) == 1, (rank, outcome)
            assert outcome.breaks[0].startswith("DistributedDataParallel runs its bookkeeping"), outcome.breaks
        else:
            assert outcome.graphs == 1 and not outcome.breaks, (rank, outcome)
