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


def _check_functional(fn, *inputs):
    """`fn` traced, functionalized, and run on copies of `inputs`: no in-place op left, the
    outputs and the mutated inputs' new values as eager's."""
    want_inputs = [x.clone() for x in inputs]
    want = fn(*want_inputs)
    result = functionalize(trace(fn, *[x.clone() for x in inputs]))
    assert not has_mutation(result.gm)
    got = result.gm(*[x.clone() for x in inputs])
    torch.testing.assert_close(got[:len(want)], want)
    for i, new in zip(result.mutated_placeholders, got[len(want):]):
        torch.testing.assert_close(new, want_inputs[i])
    unchanged = set(range(len(inputs))) - set(result.mutated_placeholders)
    for i in unchanged:
        torch.testing.assert_close(inputs[i], want_inputs[i])
    return result


def test_writes_through_views_of_an_intermediate_read_later():
    """`y[0].add_(1)` then `y` read: the write is a select_scatter into y (view_inverses.py)."""
    def fn(x):
        y = x * 1
        y[0].add_(1)
        y[:, 1:].mul_(2)
        y.t()[0].sub_(3)
        return [y, y.sum()]

    _check_functional(fn, torch.randn(3, 4))


@pytest.mark.parametrize("write", ["select", "slice", "transpose", "diagonal", "unsqueeze", "unbind", "split",
                                   "chain", "view"])
def test_writes_through_views_of_an_input(write):
    def fn(x, buf):
        if write == "select":
            buf[1].add_(x[0, :3])
        elif write == "slice":
            buf[:, ::2].mul_(2)
        elif write == "transpose":
            buf.t()[1].copy_(x[0, :3])
        elif write == "diagonal":
            buf.diagonal().add_(1)
        elif write == "unsqueeze":
            buf.unsqueeze(0)[0, 1].mul_(3)
        elif write == "unbind":
            buf.unbind(0)[2].add_(5)
        elif write == "split":
            buf.split([1, 2], 1)[1].mul_(-1)
        elif write == "chain":
            buf[1:][0][1:].add_(7)
        else:
            buf.view(9)[2:5].add_(1)
        return [x * buf.sum()]

    result = _check_functional(fn, torch.randn(3, 4), torch.randn(3, 3))
    assert result.mutated_placeholders == [1]


@pytest.mark.parametrize("first", ["clamp_", "mul_", "copy_"])
def test_a_write_through_a_view_after_a_write_of_the_whole_input(first):
    """Fuzzer seed 89: `T.clamp_()` then `T.view(2, 2).add_(1)`: the view's base is T's new
    value (an input's), so the write must reach the input; it was taken for a write of an
    intermediate nothing reads later, and the input kept the first write only."""
    def fn(x, buf):
        getattr(buf, first)(*{"clamp_": (-1.0, 1.0), "mul_": (2.0,), "copy_": (x[:3, :3],)}[first])
        buf.view(9)[2:5].add_(1)
        buf[1].mul_(-3)
        return [x * 2]

    result = _check_functional(fn, torch.randn(3, 4), torch.randn(3, 3))
    assert result.mutated_placeholders == [1]


def test_views_taken_before_a_write_and_read_after_it_see_it():
    """A view of the written tensor taken before the write, read after: taken again of its new value."""
    def fn(x, buf):
        row, col = buf[0], buf[:, 1]
        buf[0, 1:].mul_(2)
        buf.add_(1)
        t = x * 1
        tt = t.t()
        t[1].zero_()
        return [row + col, tt * 2, t]

    _check_functional(fn, torch.randn(3, 3), torch.randn(3, 3))


def test_write_through_an_as_strided_view_of_a_tensor_with_gaps_is_refused():
    """as_strided's offsets and strides place elements in a copy laid out as the original only
    where that has no gaps: refused (the graph then runs eagerly)."""
    def fn(x):
        x.as_strided((2,), (1,), x.storage_offset() + 1).add_(1)
        return [x * 2]

    with pytest.raises(FunctionalizationError, match="gaps"):
        functionalize(trace(fn, torch.randn(4, 3)[::2]))
