"""Generator functions and `contextlib.contextmanager`: the generator's body runs a step at a
time as its consumer pulls items, so its work interleaves with the consumer's as in eager."""
from __future__ import annotations

import contextlib

import torch

import torchweld
from tests.capture.helpers import CountingBackend, assert_same, check_program

LOG: list = []


def numbers(n, x):
    for i in range(n):
        LOG.append(("yield", i))  # interleaved with the consumer's appends, as in eager
        yield x * i


def consume(x):
    total = x * 0
    for y in numbers(3, x):
        LOG.append(("got",))
        total = total + y
    first = next(numbers(2, x + 1))
    pairs = list(zip(numbers(5, x), range(2)))  # zip stops pulling after two
    return total, first, len(pairs), sum(numbers(3, x))


def test_a_generator_runs_as_its_consumer_pulls():
    compiled = torchweld.compile(consume, backend=CountingBackend())
    for _ in range(2):
        x = torch.randn(3)
        LOG.clear()
        expected, eager_log = consume(x), list(LOG)
        LOG.clear()
        assert_same(compiled(x), expected)
        assert LOG == eager_log
    assert len(compiled.cache_entries) == 1 and compiled.cache_entries[0].report.break_reason is None


def endless(x):
    i = 0
    while True:
        yield x + i
        i += 1


def takes_three(x):
    out = []
    for y in endless(x):
        out.append(y)
        if len(out) == 3:
            break
    return out


def test_a_generator_that_never_ends_is_pulled_three_times():
    check_program(takes_three, (torch.randn(2),), compare_counts=False)


def returns_the_generator(x):
    return numbers(2, x)


def test_a_generator_leaving_the_frame_runs_natively():
    compiled = torchweld.compile(returns_the_generator, backend="eager")
    x = torch.randn(2)
    LOG.clear()
    assert [t.tolist() for t in compiled(x)] == [t.tolist() for t in returns_the_generator(x)]


@contextlib.contextmanager
def logged(tag):
    LOG.append(("enter", tag))
    yield tag * 2
    LOG.append(("exit", tag))


def with_a_context_manager(x):
    with logged(3) as k:
        LOG.append(("body",))
        y = x * k
    return y + 1


def test_a_contextmanager_is_inlined():
    _, backend = check_program(with_a_context_manager, (torch.randn(2),), compare_counts=False)
    assert len(backend.graphs) == 1
    LOG.clear()
    torchweld.compile(with_a_context_manager, backend="eager")(torch.randn(2))
    assert LOG == [("enter", 3), ("body",), ("exit", 3)]


def raises_in_the_block(x):
    try:
        with logged(1):
            raise ValueError("inside")
    except ValueError:
        x = x * 5
    return x


def test_an_exception_through_a_contextmanager_is_handled_as_eager():
    compiled = torchweld.compile(raises_in_the_block, backend="eager")
    for _ in range(2):
        x = torch.randn(2)
        LOG.clear()
        expected, eager_log = raises_in_the_block(x), list(LOG)
        LOG.clear()
        assert_same(compiled(x), expected)
        assert LOG == eager_log
