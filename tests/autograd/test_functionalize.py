"""functionalize: in-place aten ops become pure ones; mutated inputs become outputs."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torchweld.autograd.functionalize import FunctionalizationError, functionalize


def trace(fn, *args):
    return make_fx(fn)(*args)


def has_mutation(gm):
    return any(n.op == "call_function" and getattr(n.target, "_schema", None) is not None
               and n.target._schema.is_mutable for n in gm.graph.nodes)


def test_inplace_on_intermediate_and_input():
    def fn(x, buf):
        y = x * 2
        y.relu_()
        buf.add_(1)
        buf.mul_(y.sum())
        return [y + buf]

    x, buf = torch.randn(4), torch.randn(4)
    expected_buf = buf.clone()
    expected = fn(x, expected_buf)[0]
    result = functionalize(trace(fn, x, buf.clone()))
    assert not has_mutation(result.gm)
    assert result.mutated_placeholders == [1]
    out, new_buf = result.gm(x, buf)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_buf, expected_buf)


def test_copy_into_input():
    def fn(x, running):
        running.copy_(x.mean(0))
        return [x * running]

    x, running = torch.randn(3, 4), torch.zeros(4)
    result = functionalize(trace(fn, x, running.clone()))
    out, new = result.gm(x, running)
    torch.testing.assert_close(new, x.mean(0))
    torch.testing.assert_close(out, x * x.mean(0))


def test_inplace_on_a_view_is_refused():
    def fn(x):
        y = x * 1
        y[0].add_(1)
        return [y]

    with pytest.raises(FunctionalizationError, match="view"):
        functionalize(trace(fn, torch.randn(3, 2)))
