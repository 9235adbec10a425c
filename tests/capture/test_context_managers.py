"""`with` on context managers whose __enter__ and __exit__ are Python functions: inlined,
their side effects replayed, breaks inside the block resumed with the real __exit__."""
import contextlib
import copy
import threading

import pytest
import torch

import torchweld
from tests.capture.helpers import CountingBackend, assert_same, check_program


class Counting:
    """Counts its entries and exits on itself, and hands back a scale."""

    def __init__(self, scale=2.0):
        self.scale = scale
        self.entered = self.exited = 0

    def __enter__(self):
        self.entered += 1
        return self.scale

    def __exit__(self, kind, error, traceback):
        self.exited += 1
        return False

    def __eq__(self, other):  # the tests compare the arguments after each call with eager's
        return isinstance(other, Counting) and vars(other) == vars(self)


def made_inside(x):
    with Counting(3.0) as k:
        y = x * k
    return y + 1


def made_outside(x, counter):
    with counter as k:
        y = (x * k).sin()
    return y, counter.entered


def nested(x, counter):
    with counter as a, contextlib.nullcontext(a + 1) as b:
        y = x * a + b
    return y


NOTHING = contextlib.nullcontext("given back")


def null_context_made_outside(x):
    with NOTHING as got:
        y = x.cos()
    return y, got


@pytest.mark.parametrize("fn,calls,anchor_captures", [
    (made_inside, [(torch.randn(3),), (torch.randn(4),)], True),
    # torch.compile 2.13 runs these frames eagerly (no graph): a manager made outside, with side effects
    (made_outside, [(torch.randn(3), Counting()), (torch.randn(3), Counting(5.0))], False),
    (nested, [(torch.randn(3), Counting()), (torch.randn(3), Counting(-1.0))], False),
], ids=["made_inside", "made_outside", "nested"])
def test_a_python_context_manager_is_captured_in_one_graph(fn, calls, anchor_captures):
    check_program(fn, *calls, compare_counts=anchor_captures)
    ours = CountingBackend()
    torchweld.compile(fn, backend=ours)(*copy.deepcopy(calls[0]))
    assert len(ours.graphs) == 1


def test_null_context_made_outside():
    # torch.compile 2.13 runs this frame eagerly (no graph); torchweld captures it whole
    compiled, backend = check_program(null_context_made_outside, (torch.randn(4, 8),), compare_counts=False)
    assert len(backend.graphs) == 1 and compiled(torch.randn(4, 8))[1] == "given back"


def break_inside(x, counter):
    with counter as k:
        y = x * k
        print("inside the block")
        z = y + counter.entered
    return z, counter.exited


def break_inside_nothing(x):
    with contextlib.nullcontext(x) as y:
        z = y * 2
        print("inside nothing")
        w = z + 1
    return w


@pytest.mark.parametrize("fn,make_args", [
    (break_inside, lambda: (torch.randn(3), Counting())),
    (break_inside_nothing, lambda: (torch.randn(3),)),
], ids=["own_manager", "nullcontext"])
def test_a_break_inside_the_block_exits_the_real_manager(fn, make_args, capsys):
    compiled = torchweld.compile(fn)
    for _ in range(2):
        args = make_args()
        eager_args = copy.deepcopy(args)
        assert_same(compiled(*args), fn(*eager_args))
        assert_same(args, eager_args)  # entered and exited once, as in eager
    assert capsys.readouterr().out.count("inside ") == 4
    report = torchweld.explain(fn)(*make_args())
    assert report.graph_count == 2 and report.graph_break_count == 1
    assert "print" in str(report.break_reasons[0])


def suppressed(x):
    with contextlib.suppress(ValueError):
        y = x * 2
        raise ValueError("dropped by the manager")
    return x + 1


def always_raises(x):
    with torch.no_grad():
        y = x * 2
        raise ValueError(f"raised after {y.shape}")
    return x + 1


def test_a_block_that_raises():
    """The raise is captured: contextlib.suppress's __exit__ (inlined) swallows it, and the
    function is one graph; a no_grad block's exit lets it through, raised at the user's line."""
    x = torch.randn(3)
    assert_same(torchweld.compile(suppressed)(x), suppressed(x))
    with pytest.raises(ValueError, match="raised after"):
        torchweld.compile(always_raises)(x)
    report = torchweld.explain(suppressed)(x)
    assert report.graph_count == 1 and report.graph_break_count == 0
    assert torch.is_grad_enabled()


LOCK = threading.Lock()


def under_a_lock(x):
    with LOCK:  # __enter__ and __exit__ in C
        y = x + 1
    return y


def test_a_manager_capture_cannot_inline_runs_in_python():
    x = torch.randn(3)
    assert_same(torchweld.compile(under_a_lock)(x), under_a_lock(x))
    report = torchweld.explain(under_a_lock)(x)
    assert report.graph_count == 0 and report.graph_break_count == 1
    assert "this one runs in Python" in str(report.break_reasons[0])


_LIN_FOR_GRAD_MODE = torch.nn.Linear(2, 2)


def _enable_grad_block_breaking_in_a_loop(x):
    for _ in range(2):
        with torch.enable_grad():
            if x.sum() > 0:  # a break inside the block: the resume function enters it again
                pass
    return _LIN_FOR_GRAD_MODE.weight.sum()  # after the block: the caller's grad mode again


def test_a_block_entered_again_at_a_break_restores_the_mode_outside_it():
    """The context rebuilt at a break restores the mode outside the `with`, not the mode the
    entry code happens to be in when it rebuilds it (found by the differential fuzzer)."""
    compiled = torchweld.compile(_enable_grad_block_breaking_in_a_loop, backend="eager")
    for mode in (False, True, False):
        with torch.set_grad_enabled(mode):
            out, expected = compiled(torch.ones(2)), _enable_grad_block_breaking_in_a_loop(torch.ones(2))
            assert out.requires_grad == expected.requires_grad
            assert torch.is_grad_enabled() == mode


def _in_a_profiler_range(x):
    with torch.autograd.profiler.record_function("my range"):
        y = x * 2
    return y + 1


def _break_in_a_profiler_range(x):
    with torch.autograd.profiler.record_function("my range"):
        y = x * 2
        print("", end="")  # a graph break inside the range
    return y + 1


def test_a_profiler_range_is_no_break():
    _, backend = check_program(_in_a_profiler_range, (torch.randn(3),), compare_counts=False)
    assert len(backend.graphs) == 1
    check_program(_break_in_a_profiler_range, (torch.randn(3),), compare_counts=False)
