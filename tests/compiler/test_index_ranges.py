"""Index ranges (torchweld/compiler/index_ranges.py) and the C++ kernels they split:
a cat or a pad along the innermost loop becomes one plain loop per piece."""
import pytest
import torch
import torch.nn.functional as F

from torchweld.compiler import index_ranges, ir
from torchweld.compiler.ir import Expr, Op

from weld_helpers import check

x = ir.var("x")


def lt(a, b):
    return Expr(Op.LT, torch.bool, (a, b))


def clamp(e, lo, hi):
    return Expr(Op.MINIMUM, ir.INDEX, (Expr(Op.MAXIMUM, ir.INDEX, (e, ir.const(lo))), ir.const(hi)))


def test_value_range_of_affine_and_clamped_indices():
    bounds = {"x": (0, 9), "y": (2, 3)}
    assert index_ranges.value_range(ir.iadd(ir.imul(x, ir.const(4)), ir.var("y")), bounds) == (2, 39)
    assert index_ranges.value_range(clamp(ir.iadd(x, ir.const(-5)), 0, 3), bounds) == (0, 3)
    assert index_ranges.value_range(ir.imod(x, 4), bounds) == (0, 3)
    assert index_ranges.value_range(ir.idiv(x, 4), bounds) == (0, 2)
    assert index_ranges.value_range(ir.load("buf", ir.INDEX, [x]), bounds) is None  # int64 data: unknown
    assert index_ranges.value_range(ir.var("z"), bounds) is None


def test_simplify_folds_what_the_range_decides():
    value = Expr(Op.WHERE, torch.float32, (lt(x, ir.const(4)), ir.load("a", torch.float32, [clamp(x, 0, 3)]),
                                           ir.load("b", torch.float32, [clamp(ir.iadd(x, ir.const(-4)), 0, 5)])))
    first = index_ranges.simplify(value, {"x": (0, 3)})
    assert first.op is Op.LOAD and first.arg == "a" and first.args[0] is x
    second = index_ranges.simplify(value, {"x": (4, 9)})
    assert second.op is Op.LOAD and second.arg == "b" and ir.affine_terms(second.args[0]) == ({"x": 1}, -4)
    assert index_ranges.simplify(value, {"x": (2, 6)}).op is Op.WHERE  # straddling: nothing decided


def test_breakpoints_of_comparisons_and_clamps():
    e = Expr(Op.LOGICAL_AND, torch.bool, (Expr(Op.GE, torch.bool, (ir.iadd(x, ir.const(-1)), ir.const(0))),
                                          lt(ir.iadd(x, ir.const(-1)), ir.const(30))))
    assert index_ranges.breakpoints([e], "x", 33) == [1, 31]
    assert index_ranges.breakpoints([Expr(Op.LE, torch.bool, (x, ir.const(4)))], "x", 10) == [5]
    assert index_ranges.breakpoints([Expr(Op.EQ, torch.bool, (x, ir.const(4)))], "x", 10) == [4, 5]
    mixed = lt(ir.iadd(x, ir.var("y")), ir.const(4))  # depends on another variable too: no breakpoint
    assert index_ranges.breakpoints([mixed], "x", 10) == []
    assert index_ranges.breakpoints([lt(x, ir.const(10))], "x", 10) == []  # outside the loop


def _kernel_body(c) -> str:
    source = c.kernel_sources["cpp"]
    return source[source.index('extern "C" void'):]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_cat_along_the_innermost_loop_is_one_plain_loop_per_input(dtype):
    inputs = [torch.randn(4, 6, n).mul(3).to(dtype) for n in (5, 1, 7)]
    c = check(lambda a, b, d: torch.cat([a, b, d], -1), inputs)
    body = _kernel_body(c)
    assert body.count("for (int64_t x2") == 3
    assert "tw_min" not in body and "tw_max" not in body and "?" not in body


def test_cat_of_transposed_and_sliced_inputs():
    a = torch.randn(6, 4).t()
    b = torch.randn(4, 10)[:, ::2]
    check(lambda a, b: torch.cat([a, b, a], 1) * 2, [a, b])


def test_cat_with_empty_inputs_and_a_dim_of_size_one():
    check(lambda a, b, d: torch.cat([a, b, d], -1).sin(), [torch.randn(3, 1, 4), torch.randn(3, 1, 0), torch.randn(3, 1, 2)])
    check(lambda a, b: torch.cat([a, b]) + 1, [torch.randn(30), torch.randn(40)])  # one loop: parallel per piece


def test_pad_is_split_at_its_edges_and_crops():
    c = check(lambda a: F.pad(a, (1, 2)) + 1, [torch.randn(8, 30)])
    assert _kernel_body(c).count("for (int64_t x1") == 3 and "?" not in _kernel_body(c)
    check(lambda a: F.pad(a, (-2, 3), value=0.5) * 2, [torch.randn(8, 30)])  # a negative pad crops
    check(lambda a: F.pad(a, (2, 2, 1, 1)), [torch.randn(2, 3, 5, 7)])


def test_many_pieces_stay_one_loop():
    inputs = [torch.randn(2, 3) for _ in range(index_ranges_max() + 1)]
    c = check(lambda *ts: torch.cat(ts, -1), inputs)
    assert _kernel_body(c).count("for (int64_t x1") == 1


def index_ranges_max() -> int:
    from torchweld.tuning import tuning

    return tuning.max_pieces
