"""weld's graphs and generated kernels are named in torch.profiler traces (one range per graph
call and per kernel launch, taken only while a profiler records)."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torchweld


def _weld_ranges(fn, *args, expected=None) -> list[str]:
    """The torchweld ranges of one call of fn(*args) under a profiler (the profiled wrapper, made
    at its first use); its result is `expected`, where given."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn(*args)
    if expected is not None:
        torch.testing.assert_close(result, expected)
    return [e.name for e in prof.events() if e.name.startswith("torchweld")]


def test_inference_graph_and_kernels_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
    compiled = torchweld.compile(model)
    x = torch.randn(8, 16)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled(x), expected)
        names = _weld_ranges(compiled, x, expected=expected)
        assert _weld_ranges(compiled, x, expected=expected) == names  # the profiled wrapper, made once, again
        torch.testing.assert_close(compiled(x), expected)  # and as before once the profiler stops
    assert any(n.startswith("torchweld graph w") for n in names)
    assert any(n.startswith("torchweld kernel") and n.endswith("cpu)") for n in names)


def test_training_forward_and_backward_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    compiled = torchweld.compile(model)
    x = torch.randn(8, 16, requires_grad=True)
    compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    names = _weld_ranges(lambda t: compiled(t).sum().backward(), x)
    torch.testing.assert_close([p.grad for p in model.parameters()], grads)
    assert len({n for n in names if n.startswith("torchweld graph")}) == 2  # the forward's, the backward's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_cuda_graph_and_triton_kernels_are_named(mode):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU()).cuda()
    compiled = torchweld.compile(model, mode=mode)
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        expected = model(x)
        for _ in range(3):
            torch.testing.assert_close(compiled(x), expected)
        names = _weld_ranges(compiled, x)
        torch.testing.assert_close(compiled(x), expected)
    if mode is None:  # a CUDA graph replay launches no kernel of its own from Python
        assert any(n.startswith("torchweld kernel") and n.endswith("cuda)") for n in names)
