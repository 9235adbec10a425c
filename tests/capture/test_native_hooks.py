"""A compiled module's forward hooks run in Python around its compiled forward, as
nn.Module.__call__ runs them (capture/native_hooks.py): FSDP2's hooks, and users'."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchweld
from torchweld.capture.report import collecting


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, shift=0.0):
        return self.lin(x).relu() + shift


def _twin_runs(module: nn.Module, compiled: nn.Module, inputs: list):
    with collecting() as reports:
        for args, kwargs in inputs:
            torch.testing.assert_close(compiled(*args, **kwargs), module(*args, **kwargs))
    return reports


def test_pre_hooks_and_hooks_run_around_the_compiled_forward():
    module, calls = Scale(), []
    module.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    module.register_forward_pre_hook(lambda m, args, kwargs: (args, {**kwargs, "shift": 1.0}), with_kwargs=True)
    module.register_forward_hook(lambda m, args, out: calls.append(args[0].shape) or out + 1)
    module.register_forward_hook(lambda m, args, kwargs, out: out * kwargs["shift"] * 3, with_kwargs=True)
    compiled = torchweld.compile(module, backend="eager")
    reports = _twin_runs(module, compiled, [((torch.randn(2, 3),), {}) for _ in range(3)])
    assert len(calls) == 6  # each call, compiled and eager
    assert sum(r.graph is not None for r in reports) == 1 and not any(r.break_reason for r in reports)


def test_hooks_added_and_removed_after_compiling_are_followed():
    module = Scale()
    compiled = torchweld.compile(module, backend="eager")
    x = torch.randn(2, 3)
    torch.testing.assert_close(compiled(x), module(x))
    handle = module.register_forward_hook(lambda m, args, out: out - 5)
    torch.testing.assert_close(compiled(x), module(x))
    assert float(compiled(x).detach().max()) < 0
    handle.remove()
    torch.testing.assert_close(compiled(x), module(x))


def test_an_always_call_hook_runs_when_the_forward_raises():
    class Fails(nn.Module):
        def forward(self, x):
            return x @ torch.ones(5, 5)  # shapes refused

    module, seen = Fails(), []
    module.register_forward_hook(lambda m, args, out: seen.append(out), always_call=True)
    compiled = torchweld.compile(module, backend="eager")
    with pytest.raises(RuntimeError):
        compiled(torch.randn(2, 3))
    assert seen == [None]


def test_a_module_with_a_backward_hook_runs_as_nn_module_calls_it():
    module, grads = Scale(), []
    module.register_full_backward_hook(lambda m, gin, gout: grads.append(gout[0].shape))
    compiled = torchweld.compile(module, backend="eager")
    x = torch.randn(2, 3, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, expected = compiled(x), module(x2)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert grads == [torch.Size([2, 3])] * 2


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_hooks_registered_on_the_compiled_module_or_globally_run_once(backend):
    """Hooks registered on the compiled module are the original's (nn.Module's call of the
    wrapper ran them around it, and a global hook ran twice: once around the wrapper, once
    around the original; torch.compile's wrapper does so too)."""
    module = Scale()
    compiled = torchweld.compile(module, backend=backend)
    x = torch.randn(2, 3, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    calls = []
    handles = [compiled.register_forward_hook(lambda m, args, out: out + 1),
               compiled.register_forward_pre_hook(lambda m, args: (args[0] * 2,)),
               compiled.register_full_backward_hook(lambda m, gin, gout: calls.append("backward"))]
    for _ in range(2):
        compiled(x).sum().backward()
        module(x2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
    assert calls == ["backward"] * 4  # each call, compiled and eager
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(compiled(x), module(x))
    shift = nn.modules.module.register_module_forward_hook(lambda m, args, out: out + 1)
    try:
        for _ in range(2):
            torch.testing.assert_close(compiled(x), module(x))
    finally:
        shift.remove()
    torch.testing.assert_close(compiled(x), module(x))
