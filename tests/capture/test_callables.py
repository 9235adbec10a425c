"""Callables model code reaches for besides plain functions: custom autograd.Functions,
functools.partial, functools.lru_cache."""
import functools

import pytest
import torch

import torchweld
from tests.capture.helpers import CountingBackend, assert_same, check_program


class CubicGrad(torch.autograd.Function):
    """x * x forward, with a backward of its own (3x, not autograd's 2x): compiled code must
    run this backward, not differentiate the forward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * x * scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x * ctx.scale, None


def uses_function(x):
    return CubicGrad.apply(x.sin(), 2.0) + 1


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_a_custom_autograd_function_is_one_node_and_keeps_its_backward(backend):
    x = torch.randn(5, requires_grad=True)
    counting = CountingBackend()
    compiled = torchweld.compile(uses_function, backend=counting if backend == "eager" else "weld")
    out = compiled(x)
    out.sum().backward()
    ours, x.grad = x.grad, None
    expected = uses_function(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(ours, x.grad)  # 3x: the Function's own backward ran
    if backend == "eager":
        assert len(counting.graphs) == 1
        targets = [n.target.__name__ for n in counting.graphs[0].graph.nodes if n.op == "call_function"]
        assert "CubicGrad_apply" in targets


def test_a_custom_autograd_function_without_grad_matches_torch_compile():
    with torch.no_grad():
        check_program(uses_function, (torch.randn(4),), (torch.randn(2, 3),))


def scaled(t, factor, *, shift=0.0):
    return t * factor + shift


HALF = functools.partial(scaled, factor=0.5, shift=1.0)
DOUBLE = functools.partial(scaled, 2.0)


def partials_from_outside(x):
    return HALF(x) + DOUBLE(x, shift=3.0)


def partial_made_inside(x):
    triple = functools.partial(scaled, factor=3.0)
    return triple(x, shift=-1.0)


@pytest.mark.parametrize("fn", [partials_from_outside, partial_made_inside])
def test_partials_are_called_through(fn):
    _, backend = check_program(fn, (torch.randn(3),), (torch.randn(2, 2),))
    assert len(backend.graphs) == 2  # one per shape, no break


CALLS = []


@functools.lru_cache
def expensive_setting(name):
    CALLS.append(name)
    return {"scale": 3.0}[name]


@functools.lru_cache
def tensor_helper(t):
    return t * 2


def uses_cached_functions(x):
    return x * expensive_setting("scale") + tensor_helper(x)


def test_a_cached_function_of_constants_is_folded_and_one_of_tensors_is_inlined():
    CALLS.clear()
    expensive_setting.cache_clear()
    backend = CountingBackend()
    compiled = torchweld.compile(uses_cached_functions, backend=backend, fullgraph=True)
    for shape in ((3,), (3,), (2, 2)):
        x = torch.randn(shape)
        assert_same(compiled(x), uses_cached_functions(x))
    assert CALLS == ["scale"]  # one real call, cached, whatever compiled or ran eagerly
    assert len(backend.graphs) == 2


def test_map_filter_and_reduce_over_python_values_are_one_graph():
    def fn(x, values):
        doubled = map(lambda v: v * 2, filter(lambda v: v > 0, values))
        product = functools.reduce(lambda a, b: a * b, [1, 2, 3], 1)
        pairs = list(map(lambda a, b: a + b, [1, 2], (10, 20, 30)))
        truthy = list(filter(None, [0, 1, "", "a"]))
        return x * sum(doubled) + product, pairs, truthy

    compiled, backend = check_program(fn, (torch.randn(3), [1, -2, 3]), (torch.randn(3), [4, 5]))
    assert len(backend.graphs) == 2  # the second list of values is a guard miss, not a break


def test_map_over_an_iterator_pulls_lazily():
    def fn(x):
        it = iter([1, 2, 3, 4])
        first = next(map(lambda v: v * 10, it))  # map took one item of `it`
        return x * (first + sum(it))

    check_program(fn, (torch.randn(2),))


def test_next_of_reversed_is_an_iterator():
    import collections

    def fn(x):
        od = collections.OrderedDict([("a", 1), ("b", 2)])
        empty = collections.OrderedDict()
        return x * next(reversed(od.values())), next(reversed(empty.values()), x)

    check_program(fn, (torch.randn(2),), compare_counts=False)
