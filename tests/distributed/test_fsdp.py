"""FSDP2 (`fully_shard`) with compiled models: FSDP2's hooks (all-gather before a module's forward,
free after it, reduce-scatter in the backward) run in Python, each sharded module's forward is
captured (capture/native_hooks.py). Compared with eager FSDP2 after every step; 2 ranks on gloo."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from gloo_ranks import on_two_ranks, requires_gloo

import torchweld
from torchweld.capture.report import collecting

pytestmark = requires_gloo


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc(self.norm(x))) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _shard(model: Net, recipe: str, backend: str, policy):
    """The model sharded per block and at the root as `recipe` says; what to call."""
    from torch.distributed.fsdp import fully_shard

    compile_ = lambda m: torchweld.compile(m, backend=backend)  # noqa: E731
    if recipe == "compile_then_shard":  # torch.compile's recipe: compile each block, then shard it
        for i, block in enumerate(model.blocks):
            model.blocks[i] = compile_(block)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if recipe == "shard_then_compile":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = compile_(block)
    if recipe == "compile_root":
        return compile_(model)
    if recipe == "compiled_step":
        return compile_(lambda x: model(x))
    return model


def train(rank: int, recipe: str, backend: str, bf16: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    torch.manual_seed(0)
    base = Net()
    eager_model, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    reference = _shard(eager_model, "eager", backend, policy)
    compiled = _shard(compiled_model, recipe, backend, policy)
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (eager_model, compiled_model)]
    torch.manual_seed(rank + 1)
    diffs = []
    with collecting() as reports:
        for _ in range(3):
            x = torch.randn(4, 16)
            for model, optimizer in zip((reference, compiled), optimizers):
                model(x).float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            diffs.append(max(float((a.full_tensor() - b.full_tensor()).detach().abs().max())
                             for a, b in zip(eager_model.parameters(), compiled_model.parameters())))
    return {"diffs": diffs, "graphs": sum(r.graph is not None for r in reports),
            "graph_ops": sum(r.op_count for r in reports),
            "eager": [r.break_reason.reason for r in reports if r.graph is None and r.break_reason
                      and "FSDP2's hooks" not in r.break_reason.reason]}


CASES = [("shard_then_compile", "eager", False), ("compile_then_shard", "eager", False),
         ("compile_root", "eager", False), ("compiled_step", "eager", False),
         ("compile_root", "weld", False), ("shard_then_compile", "weld", False),
         ("compile_then_shard", "weld", False), ("compile_root", "eager", True)]


def many_blocks(rank: int) -> dict:
    """torchweld.compile(sharded_root) of 12 blocks: each block's forward compiled, and the root's
    loop resumed compiled after each (the cache limit counts per block instance and per loop
    position: 8 versions in all would leave the last 4 eager)."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    models = []
    for _ in range(2):  # one compiled, one eager, same weights
        torch.manual_seed(0)
        model = Net()
        model.blocks = nn.ModuleList(Block() for _ in range(12))
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        models.append(model)
    compiled = torchweld.compile(models[0], backend="eager")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    with collecting() as reports, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
        out.sum().backward()
    expected = models[1](x)
    expected.sum().backward()
    grads = [(a.grad - b.grad).abs().max().full_tensor() for a, b in zip(models[0].parameters(), models[1].parameters())]
    return {"block_graphs": sum(r.graph is not None and r.function == "Block.forward" for r in reports),
            "warnings": [str(w.message) for w in caught], "output_diff": float((out - expected).abs().max()),
            "grad_diff": float(max(grads))}


def train_all(rank: int, cases: list) -> list[dict]:
    return [train(rank, *case) for case in cases] + [many_blocks(rank)]


@pytest.fixture(scope="module")
def outcomes():
    per_rank = on_two_ranks(train_all, CASES)
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate([*CASES, "many_blocks"])}


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_fsdp2_trains_as_eager_fsdp2(outcomes, case):
    recipe, backend, bf16 = case
    for outcome in outcomes[case]:
        assert max(outcome["diffs"]) <= (0.0 if backend == "eager" else 1e-5), outcome
        assert outcome["graphs"] >= 3 and not outcome["eager"], outcome  # each block's forward compiled


def test_each_sharded_block_of_a_deep_model_is_compiled(outcomes):
    for outcome in outcomes["many_blocks"]:
        assert outcome["block_graphs"] >= 12, outcome
        assert outcome["output_diff"] == 0.0 and outcome["grad_diff"] == 0.0, outcome
        # neither the blocks' forward nor the root's loop resuming after each block runs eagerly
        assert not [w for w in outcome["warnings"] if "cache_size_limit" in w], outcome["warnings"]
