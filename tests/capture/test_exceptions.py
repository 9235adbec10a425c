"""Exceptions inside captured code: a `raise`, a missing key, an exhausted iterator,
caught by a handler of the frame or of an inlined function, are captured (no break);
one nothing catches is raised by the native instruction, as eager raises it."""
from __future__ import annotations

import collections.abc

import pytest
import torch

import torchweld
from tests.capture.helpers import CountingBackend, assert_same, check_program


def raise_caught(x):
    try:
        raise ValueError("no")
    except ValueError:
        x = x + 1
    return x * 2


def missing_key(x, d):
    try:
        y = d["missing"]
    except KeyError as e:
        y = len(str(e))
    return x * y


def finally_runs(x):
    out = []
    try:
        out.append(1)
        raise KeyError("k")
    except (IndexError, KeyError):
        out.append(2)
    else:
        out.append(3)
    finally:
        out.append(4)
    return x * sum(out), out


def nested(x):
    try:
        try:
            raise IndexError
        except KeyError:
            return x - 1  # not taken: an IndexError is no KeyError
    except LookupError:
        return x + 1


def _inner(d):
    return d["absent"]


def raised_in_a_callee(x):
    try:
        return x * _inner({})
    except KeyError:
        return x * 3


def exhausted(x):
    it = iter([1])
    next(it)
    try:
        next(it)
    except StopIteration:
        x = x * 5
    return x


def reraised(x):
    try:
        try:
            raise KeyError("a")
        except KeyError:
            x = x + 1
            raise
    except KeyError:
        x = x * 2
    return x


@pytest.mark.parametrize("fn", [raise_caught, finally_runs, nested, raised_in_a_callee, exhausted, reraised])
def test_an_exception_caught_in_captured_code_is_one_graph(fn):
    _, backend = check_program(fn, (torch.randn(3),), compare_counts=False)
    assert len(backend.graphs) == 1


def test_a_missing_key_caught():
    _, backend = check_program(missing_key, (torch.randn(3), {"a": 1}), compare_counts=False)
    assert len(backend.graphs) == 1


class Registry(collections.abc.MutableMapping):
    """transformers' GeneralInterface: a local and a class-wide mapping; `get()` is
    Mapping.get, which catches the KeyError of a missing key."""

    _global = {"sdpa": torch.nn.functional.scaled_dot_product_attention}

    def __init__(self):
        self._local = {}

    def __getitem__(self, key):
        if key in self._local:
            return self._local[key]
        return self._global[key]

    def __setitem__(self, key, value):
        self._local[key] = value

    def __delitem__(self, key):
        del self._local[key]

    def __iter__(self):
        return iter({**self._global, **self._local})

    def __len__(self):
        return len(self._global.keys() | self._local.keys())


REGISTRY = Registry()


def eager_attention(q, k, v):
    return (q @ k.transpose(-1, -2)).softmax(-1) @ v


def attention(q, k, v, implementation):
    fn = REGISTRY.get(implementation, eager_attention)  # "eager" is not in it: the default
    return fn(q, k, v)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_transformers_attention_lookup_is_one_graph(implementation):
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    _, backend = check_program(attention, (q, k, v, implementation), compare_counts=False)
    assert len(backend.graphs) == 1


def uncaught(x, d):
    y = x + 1
    return y * d["missing"]


def test_an_uncaught_exception_is_raised_at_the_users_line():
    compiled = torchweld.compile(uncaught, backend="eager")
    with pytest.raises(KeyError, match="missing"):
        compiled(torch.randn(2), {})


def assert_in_the_middle(x, n):
    x = x + 1
    assert n > 0, "n must be positive"
    return x * n


def test_a_failing_assert_raises_assertion_error():
    compiled = torchweld.compile(assert_in_the_middle, backend="eager")
    assert_same(compiled(torch.ones(2), 2), assert_in_the_middle(torch.ones(2), 2))
    with pytest.raises(AssertionError, match="positive"):
        compiled(torch.ones(2), -1)


def _break_in_handler(x, d):
    try:
        y = d["missing"]
    except KeyError:
        print("", end="")  # a graph break inside the handler
        y = 2
    return x * y


def test_a_break_inside_a_handler_of_a_captured_raise():
    """A break inside an `except` block entered by a captured raise cannot rebuild the
    exception state: that frame is captured again with raises ending the capture."""
    compiled = torchweld.compile(_break_in_handler, backend=CountingBackend())
    for _ in range(2):
        x = torch.randn(2)
        assert_same(compiled(x, {}), _break_in_handler(x, {}))


def test_a_handler_after_the_break_has_the_stack_it_needs(tmp_path):
    """The resume code's stack depth covers handlers entered only by a raise: too small a depth
    let the handler's pushes overwrite the next frame (a segfault when `print` called into a
    Python-level stdout, as pytest's capture is)."""
    import io
    import sys

    compiled = torchweld.compile(_break_in_handler, backend="eager")
    stream = open(tmp_path / "out.txt", "wb+")
    old, sys.stdout = sys.stdout, io.TextIOWrapper(stream, encoding="utf-8", write_through=True)
    try:
        for _ in range(3):
            x = torch.randn(2)
            assert_same(compiled(x, {}), _break_in_handler(x, {}))
    finally:
        sys.stdout.detach()
        sys.stdout = old
        stream.close()
