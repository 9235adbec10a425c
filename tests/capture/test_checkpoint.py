"""Activation checkpointing (`torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`)
captured in one graph (capture/checkpoint.py): outputs, gradients, random numbers and batch-norm
statistics as eager's, activations recomputed rather than saved, and a break where capture
cannot keep eager's semantics."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchweld
from tests.capture.helpers import CountingBackend


class Block(nn.Module):
    def __init__(self, dropout=0.0, norm=False):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.norm(self.a(x))))) + x


class Net(nn.Module):
    def __init__(self, n=3, **block):
        super().__init__()
        self.blocks = nn.ModuleList([Block(**block) for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.pow(2).mean()


def _train_steps(model, compiled, steps=3):
    """Loss, input gradient and parameter gradients (and buffers) for each step, eager and compiled."""
    eager_model = copy.deepcopy(model)
    for step in range(steps):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        got = []
        for m, f in ((eager_model, eager_model), (model, compiled)):
            xi = x.clone().requires_grad_()
            torch.manual_seed(100 + step)
            loss = f(xi)
            loss.backward()
            got.append((loss.detach(), xi.grad, [p.grad.clone() for p in m.parameters()],
                        [b.clone() for b in m.buffers()]))
            m.zero_grad()
        torch.testing.assert_close(got[0], got[1])


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_checkpointed_blocks_train_in_one_graph(backend):
    torch.manual_seed(0)
    model = Net()
    counting = CountingBackend() if backend == "eager" else None
    compiled = torchweld.compile(model, backend=counting or backend)
    _train_steps(model, compiled)
    if counting:
        assert len(counting.graphs) == 1
        targets = [n.target for n in counting.graphs[0].graph.nodes if n.op == "call_function"]
        assert targets.count(checkpoint) == 3


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_dropout_inside_a_checkpointed_block_recomputes_the_same_mask(backend):
    """The recompute draws what the forward drew (checkpoint's preserve_rng_state): gradients as eager's."""
    torch.manual_seed(0)
    model = Net(dropout=0.3)
    _train_steps(model, torchweld.compile(model, backend=backend))


class GumbelNet(nn.Module):
    """A checkpointed block drawing random numbers through a function (not a module)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        y = checkpoint(lambda t: F.gumbel_softmax(self.a(t), tau=1.0) * t, x, use_reentrant=False)
        return y.pow(2).mean()


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_a_random_function_inside_a_checkpointed_block_draws_as_eager(backend):
    """gumbel_softmax draws random numbers: weld's joint trace cannot replay them in the
    recompute, so the block runs under eager's checkpoint (weld traced it once, drawing with
    its own generator: the forward differed from eager's)."""
    torch.manual_seed(0)
    model = GumbelNet()
    _train_steps(model, torchweld.compile(model, backend=backend))


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_batch_norm_inside_a_checkpointed_block_updates_its_statistics_as_eager(backend):
    torch.manual_seed(0)
    model = Net(norm=True)
    _train_steps(model, torchweld.compile(model, backend=backend))


def test_activations_are_recomputed_not_saved():
    """Fewer tensors saved for backward than the same model without checkpoint (eager backend)."""
    def saved_count(fn, x):
        count = [0]

        def pack(t):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x).backward()
        return count[0]

    torch.manual_seed(0)
    model = Net(n=4)
    plain = copy.deepcopy(model)
    plain.forward = lambda x: _plain_forward(plain, x)
    x = torch.randn(6, 8, requires_grad=True)
    compiled = torchweld.compile(model, backend="eager")
    compiled(x)  # compiled; the count below is of one call
    assert saved_count(compiled, x) < saved_count(plain, x)


def _plain_forward(model, x):
    for block in model.blocks:
        x = block(x)
    return x.pow(2).mean()


def test_several_outputs_and_a_passed_through_input():
    def block(x, y):
        h = torch.tanh(x @ y)
        return h, x, 3

    def fn(x, y):
        h, same, n = checkpoint(block, x, y, use_reentrant=False)
        return (h * n + same.sum()).sum()

    backend = CountingBackend()
    compiled = torchweld.compile(fn, backend=backend)
    for _ in range(2):
        x, y = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        x2, y2 = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        compiled(x, y).backward()
        fn(x2, y2).backward()
        torch.testing.assert_close((x.grad, y.grad), (x2.grad, y2.grad))
    assert len(backend.graphs) == 1


CALLS = []


def _noting_block(x):
    CALLS.append(1)  # a Python change its recompute would make again, in eager
    return torch.sin(x)


@pytest.mark.parametrize("case", ["reentrant", "unset", "side effect"])
def test_what_capture_cannot_keep_runs_with_eagers_checkpoint(case):
    import warnings

    def fn(x):
        if case == "reentrant":
            y = checkpoint(torch.sin, x, use_reentrant=True)
        elif case == "unset":
            y = checkpoint(torch.sin, x)
        else:
            y = checkpoint(_noting_block, x, use_reentrant=False)
        return (y * 2).sum()

    compiled = torchweld.compile(fn, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning about an unset use_reentrant
        for _ in range(2):
            CALLS.clear()
            x = torch.randn(5, requires_grad=True)
            x2 = x.detach().clone().requires_grad_()
            compiled(x).backward()
            compiled_calls = len(CALLS)
            CALLS.clear()
            fn(x2).backward()
            torch.testing.assert_close(x.grad, x2.grad)
            assert compiled_calls == len(CALLS)
        report = torchweld.explain(fn)(torch.randn(5, requires_grad=True))
    assert report.graph_break_count >= 1
    assert "checkpoint" in " ".join(map(str, report.break_reasons))


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_a_block_writing_a_closures_tensor_runs_with_eagers_checkpoint(backend):
    """The block changes in place a tensor it reads through its closure (not an argument): eager's
    checkpoint saves nothing of it and trains; outlined, it would become an argument, and autograd
    would refuse it as changed in place. Writing the block's own argument or intermediates is kept."""
    def fn(x, y):
        def block(t):
            y.mul_(2)
            return t * y
        return checkpoint(block, x, use_reentrant=False).sum()

    def own(x):
        def block(t):
            u = t * 3
            u.add_(1)
            return u.sin()
        return checkpoint(block, x, use_reentrant=False).sum()

    compiled, compiled_own = torchweld.compile(fn, backend=backend), torchweld.compile(own, backend=backend)
    for _ in range(2):
        x, y = torch.randn(3, requires_grad=True), torch.randn(3)
        x2, y2 = x.detach().clone().requires_grad_(), y.clone()
        compiled(x, y).backward()
        fn(x2, y2).backward()
        torch.testing.assert_close((x.grad, y), (x2.grad, y2))
        x, x2 = torch.randn(3, requires_grad=True), None
        x2 = x.detach().clone().requires_grad_()
        compiled_own(x).backward()
        own(x2).backward()
        torch.testing.assert_close(x.grad, x2.grad)
    report = torchweld.explain(own)(torch.randn(3, requires_grad=True))
    assert report.graph_break_count == 0


def test_a_checkpoint_first_in_the_graph():
    """checkpoint the first operation, before any input is read (capture crashed on the empty graph)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self):
            return checkpoint(lambda: self.w.sin() * 2, use_reentrant=False).sum()

    model = M()
    compiled = torchweld.compile(model, backend="eager", fullgraph=True)
    for _ in range(2):
        compiled().backward()
        got = model.w.grad.clone()
        model.w.grad = None
        model().backward()
        torch.testing.assert_close(got, model.w.grad)
        model.w.grad = None


def test_graph_count_matches_torch_compile():
    torch.manual_seed(0)
    model = Net()
    ours, theirs = CountingBackend(), CountingBackend()
    x = torch.randn(6, 8, requires_grad=True)
    torchweld.compile(model, backend=ours)(x).backward()
    torch.compile(model, backend=theirs)(x).backward()
    assert len(ours.graphs) == len(theirs.graphs) == 1
