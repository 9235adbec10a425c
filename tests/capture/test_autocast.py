"""`with torch.autocast(...)` inside a compiled function (capture/autocast.py): the region is
captured as torch.compile captures it (`_enter_autocast`/`_exit_autocast` nodes), its
operations run in autocast's dtypes under every backend, and a break inside it leaves and
enters it again. On the CPU with bfloat16, the autocast CI can run."""
import contextlib
import copy
import operator
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchweld
from tests.capture.helpers import CountingBackend, assert_same, check_program

BF16 = torch.bfloat16


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


LIN = _linear()


def region(x):
    y = x.sin()
    with torch.autocast("cpu", dtype=BF16):
        z = LIN(y)
        inside = torch.is_autocast_enabled("cpu")
    return z.float() * 2, z.dtype, inside, torch.is_autocast_enabled("cpu")


def nested_off(x):  # the rotary-embedding pattern of Llama-family models
    with torch.autocast("cpu", dtype=BF16):
        a = LIN(x)
        with torch.autocast("cpu", enabled=False):
            b = a.float() @ a.float().t()
        return b, LIN(a)


@torch.autocast("cpu", dtype=BF16)
def _decorated(x):
    return LIN(x)


def decorated(x):
    return _decorated(x).float() + 1


def legacy_spelling(x):
    with torch.cpu.amp.autocast():
        return LIN(x)


@pytest.mark.parametrize("fn", [region, nested_off, decorated, legacy_spelling])
def test_region_captured_like_torch_compile(fn):
    # torch.compile 2.13 on CPython 3.13 fails on torch.cpu.amp.autocast() (KeyError: dtype)
    anchor_works = not (fn is legacy_spelling and sys.version_info >= (3, 13))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cpu.amp.autocast is deprecated
        _, backend = check_program(fn, (torch.randn(4, 8),), (torch.randn(3, 8),), compare_counts=anchor_works)
    assert len(backend.graphs) == 2  # one per shape
    targets = [n.target for n in backend.graphs[0].graph.nodes]
    assert targets.count(torch.amp._enter_autocast) == targets.count(torch.amp._exit_autocast) >= 1
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("fn", [region, nested_off, decorated])
def test_weld_compiles_the_casts(fn):
    x = torch.randn(4, 8)
    ours, theirs = torchweld.compile(fn, backend="weld")(x), fn(x)
    for a, b in zip(ours, theirs) if isinstance(theirs, tuple) else [(ours, theirs)]:
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)  # bfloat16 rounding
        else:
            assert a == b
    assert not torch.is_autocast_enabled("cpu")


def break_inside(x):
    with torch.autocast("cpu", dtype=BF16):
        z = LIN(x)
        print("inside the region")
        w = LIN(z)
    return w * 2, torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_break_inside_region(backend, capsys):
    x = torch.randn(4, 8)
    compiled = torchweld.compile(break_inside, backend=backend)
    for _ in range(2):
        ours, theirs = compiled(x), break_inside(x)
        assert ours[0].dtype == theirs[0].dtype == BF16 and ours[1] is theirs[1] is False
        torch.testing.assert_close(ours[0].float(), theirs[0].float(), atol=2e-2, rtol=2e-2)
        assert not torch.is_autocast_enabled("cpu")
    assert capsys.readouterr().out.count("inside the region") == 4
    report = torchweld.explain(break_inside)(x)
    # the region's end, in the resume function, is a second break (torch.compile: one)
    assert report.graph_count == 3 and report.graph_break_count == 2
    assert "torch.autocast region begun outside this graph" in str(report.break_reasons[1])


def test_region_argument_from_data_breaks_the_graph():
    def fn(x):
        with torch.autocast("cpu", dtype=BF16, enabled=bool(x.sum() > 0)):
            return LIN(x)

    x = torch.ones(2, 8)
    assert_same(torchweld.compile(fn, backend=CountingBackend())(x), fn(x))
    assert not torch.is_autocast_enabled("cpu")
    assert torchweld.explain(fn)(x).graph_break_count >= 1


def test_decorator_object_guarded_by_identity():
    def fn(x, ctx):
        with ctx:
            return LIN(x)

    backend = CountingBackend()
    compiled = torchweld.compile(fn, backend=backend)
    x = torch.randn(2, 8)
    assert compiled(x, torch.autocast("cpu", dtype=BF16)).dtype == BF16
    assert compiled(x, torch.autocast("cpu", enabled=False)).dtype == torch.float32  # another object: recompiled
    assert len(backend.graphs) == 2
    for ctx in (torch.autocast("cpu", dtype=BF16), torch.autocast("cpu", enabled=False)):
        assert_same(compiled(x, ctx), fn(x, ctx))


def test_train_step_with_region_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    reference = copy.deepcopy(model)

    def step(model, x, y):
        with torch.autocast("cpu", dtype=BF16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss = torchweld.compile(step, backend="weld")(model, x, y)
    torch.testing.assert_close(loss, step(reference, x, y), atol=1e-2, rtol=1e-2)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-2, rtol=5e-2)


def test_empty_region_leaves_no_nodes():
    def fn(x):
        with torch.autocast("cpu", dtype=BF16):
            pass
        return x * 2

    backend = CountingBackend()
    assert_same(torchweld.compile(fn, backend=backend)(torch.ones(3)), fn(torch.ones(3)))
    assert [n.target for n in backend.graphs[0].graph.nodes if n.op == "call_function"] == [operator.mul]


# -- contextlib.nullcontext: what training code puts where autocast is off ----------------------


def amp_or_nothing(x, amp):
    with torch.autocast("cpu", dtype=BF16) if amp else contextlib.nullcontext():
        return LIN(x).float() * 2


def test_null_context_or_autocast_is_captured_like_torch_compile():
    x = torch.randn(4, 8)
    with torch.no_grad():
        _, backend = check_program(amp_or_nothing, (x, False), (x, True), (x, False))
    assert len(backend.graphs) == 2  # one per branch; the nullcontext leaves no node
    assert [n.target for n in backend.graphs[0].graph.nodes if n.op == "call_function"] == [operator.mul]
