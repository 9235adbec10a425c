"""Lowering an aten graph: in-place updates of extern results, and the aten graph
batch norm reaches on CUDA (cudnn_batch_norm) decomposed to pointwise math."""
import os

import pytest
import torch
import torch.nn.functional as F

import torchweld
from torchweld.compiler import compile_graph
from torchweld.compiler.aten_graph import to_aten_graph

from weld_helpers import check

aten = torch.ops.aten


def test_in_place_update_of_a_multi_output_extern():
    # the result of an extern returning a tuple is named `<extern>_<i>`; relu_ on it rebinds it
    def fn(x):
        values, indices = F.max_pool2d(x, 2, return_indices=True)
        F.relu(values, inplace=True)
        return values * 2, indices

    compiled = torchweld.compile(fn, backend="weld")
    with torch.no_grad():
        for x in (torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)):
            torch.testing.assert_close(compiled(x), fn(x))


def test_cudnn_batch_norm_is_pointwise():
    def fn(x, w, b, mean, var):
        return aten.cudnn_batch_norm(x, w, b, mean, var, False, 0.1, 1e-5)[0].relu_()

    args = [torch.randn(2, 4, 3, 3), torch.rand(4), torch.randn(4), torch.randn(4), torch.rand(4) + 0.5]
    aten_gm = to_aten_graph(torch.fx.symbolic_trace(fn), args).gm
    assert "cudnn_batch_norm" not in aten_gm.code
    expected = F.batch_norm(args[0], args[3], args[4], args[1], args[2], False, 0.1, 1e-5).relu()
    compiled = check(lambda x, w, b, mean, var: F.batch_norm(x, mean, var, w, b, False, 0.1, 1e-5).relu_(), args)
    assert compiled.externs == []
    torch.testing.assert_close(compiled.fn(*args)[0], expected)


POOLS = [  # (kernel_size, stride, padding, dilation, ceil_mode)
    (3, 2, 1, 1, False),  # resnet's stem
    (2, 2, 0, 1, False),
    (3, 1, 1, 1, False),
    (3, 2, 0, 1, True),  # the last window hangs over the edge
    ((2, 3), (1, 2), (1, 0), (2, 1), False),
]


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
@pytest.mark.parametrize("pool", POOLS, ids=str)
def test_max_pool_is_a_pointwise_window_max(codegen, pool):
    """Without indices, max_pool2d is a window maximum that batch norm and ReLU fuse into:
    no extern, and no stored ReLU result."""
    if codegen == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path runs on CPU through the interpreter")
    kernel, stride, padding, dilation, ceil_mode = pool

    def fn(x, scale):
        return F.max_pool2d((x * scale).relu(), kernel, stride, padding, dilation, ceil_mode)

    x = torch.randn(2, 3, 9, 10)
    x[0, 0, 4, 4] = float("nan")  # propagates, as in eager
    for inp in (x, x.to(memory_format=torch.channels_last)):
        compiled = check(fn, [inp, torch.rand(3, 1, 1)], options={"cpu_codegen": codegen})
        assert compiled.externs == []
        assert len(compiled.schedule.kernels()) == 1


def _pair(v):
    return [v, v] if isinstance(v, int) else list(v)


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
@pytest.mark.parametrize("pool", POOLS, ids=str)
def test_max_pool_offsets_and_the_backward_from_them_are_kernels(codegen, pool):
    """What training saves of a max pool (runtime/pool_offsets.py): each window's argmax as a
    byte, chosen as aten's kernels choose (NaN, windows of -inf, windows half in the
    padding), and the input's gradient from those bytes, both computed by kernels and equal
    to the aten-built implementations."""
    if codegen == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path runs on CPU through the interpreter")
    from torchweld.runtime.pool_offsets import max_pool2d_backward_from_offsets, max_pool2d_offsets

    kernel, stride, padding, dilation, ceil_mode = pool
    window = (_pair(kernel), _pair(stride), _pair(padding), _pair(dilation))
    x = torch.randn(2, 3, 9, 10)
    x[0, 0, 4, 4] = x[0, 0, 4, 5] = float("nan")  # the last NaN of a window is its argmax
    x[1, 1, :4, :4] = float("-inf")  # windows of -inf name their first position inside the input
    x[1, 2, 2:6, 2:6] = 1.0  # ties: the first maximum
    for inp in (x, x.to(memory_format=torch.channels_last)):
        compiled = check(lambda t: max_pool2d_offsets(t, *window, ceil_mode), [inp], options={"cpu_codegen": codegen})
        assert compiled.externs == []
        offsets = max_pool2d_offsets(inp, *window, ceil_mode)
        grad = torch.randn(offsets.shape).to(memory_format=torch.channels_last if inp is not x else torch.contiguous_format)
        compiled = check(lambda g, o: max_pool2d_backward_from_offsets(g, o, list(x.shape), *window, ceil_mode),
                         [grad, offsets], options={"cpu_codegen": codegen})
        assert compiled.externs == []


def test_max_pool_of_half_and_with_indices():
    x = torch.randn(2, 4, 8, 8).half()
    compiled = check(lambda t: F.max_pool2d(t, 3, 2, 1), [x])
    assert compiled.externs == []
    # the indices are read: the aten kernel computes both
    compiled = check(lambda t: F.max_pool2d(t, 2, return_indices=True), [torch.randn(2, 3, 8, 8)])
    assert compiled.externs


def test_safe_softmax_is_fused_and_zeroes_fully_masked_rows():
    """On CUDA, scaled_dot_product_attention under a boolean mask runs its math path,
    whose `_safe_softmax` (zeros for a row that masks everything) must not stay an
    extern call (BERT: 12 extern softmaxes and 36 helper kernels per call)."""
    scores = torch.randn(2, 4, 8, 8)
    scores[:, :, 3] = float("-inf")  # a query that may attend to nothing

    compiled = check(lambda s: torch.ops.aten._safe_softmax(s, -1), [scores])
    assert compiled.externs == []
    assert compiled(scores)[:, :, 3].eq(0).all()


def test_unravelled_index_folds_back():
    """A reshape of a contiguous tensor read through its view: the div/mod terms of the
    unravelled index fold back into one term (the row sums of a layer norm's weight gradient
    then read (batch*sequence, features) as plain rows); other strides are left alone."""
    from torchweld.compiler import ir

    d0, d1 = ir.var("d0"), ir.var("d1")
    folded = ir.flat_index(ir.unravel(d0, (8, 256)) + [d1], (196608, 768, 1))
    assert folded.key() == ir.iadd(ir.imul(d0, ir.const(768)), d1).key()
    assert ir.flat_index(ir.unravel(d0, (4, 6, 5)), (30, 5, 1), 7).key() == ir.iadd(ir.const(7), d0).key()
    transposed = ir.flat_index(ir.unravel(d0, (4, 6, 5)), (1, 4, 24))
    assert any(n.op is ir.Op.IMOD for n in ir.walk(transposed))
    assert ir.linear_coefficient(transposed, "d0") is None
    assert ir.linear_coefficient(ir.flat_index([d0, d1], (768, 1), 3), "d0") == 768


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_foreach_ops_lower_per_tensor_and_each_tensor_fuses_into_one_kernel(codegen):
    """An optimizer's multi-tensor ops: no extern (pow of a constant base, which Triton renders
    as exp2, and of a 0-d tensor base, Adam's betas read as graph inputs, included), one kernel
    per tensor, results equal to the foreach kernels'."""
    if codegen == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path runs on CPU through the interpreter")

    def update(a, b, g1, g2, s1, s2, beta):
        params, grads, steps = [a, b], [g1, g2], [s1, s2]
        torch._foreach_add_(steps, 1)
        torch._foreach_lerp_(grads, params, 0.25)
        torch._foreach_addcmul_(params, grads, grads, 0.5)
        corrections = torch._foreach_pow(0.9, steps)
        torch._foreach_add_(corrections, torch._foreach_pow([beta, beta], steps))
        torch._foreach_maximum_(params, grads)
        torch._foreach_addcdiv_(params, grads, torch._foreach_add(corrections, 1.0))
        return (torch._foreach_sqrt(torch._foreach_abs(params))[1],)

    inputs = [torch.randn(5, 3), torch.randn(7), torch.randn(5, 3), torch.randn(7), torch.tensor(2.0), torch.tensor(4.0),
              torch.tensor(0.999)]
    expected_inputs = [t.clone() for t in inputs]
    gm = torch.fx.symbolic_trace(update)
    with torch.no_grad():
        compiled = compile_graph(gm, [t.clone() for t in inputs], {"cpu_codegen": codegen})
        expected = update(*expected_inputs)
        got = compiled(*inputs)
    torch.testing.assert_close(got[0], expected[0])
    for a, b in zip(inputs, expected_inputs):
        torch.testing.assert_close(a, b)
    assert compiled.externs == []
    assert len(compiled.schedule.kernels()) <= 3  # the two steps, then one kernel per tensor


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_lerp_with_tensor_weights_is_pointwise(codegen):
    """A tensor weight (Adam's betas read as graph inputs): aten's two formulas, chosen
    per element by |w| < 0.5 (bit for bit in C++; Triton may fuse a multiply-add), for a
    0-d weight and a broadcast one."""
    if codegen == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path runs on CPU through the interpreter")

    def fn(start, end, scalar_weight, weights):
        return torch.lerp(start, end, scalar_weight), torch.lerp(start, end, weights)

    inputs = [torch.randn(4, 6), torch.randn(4, 6), torch.tensor(0.1), torch.tensor([-0.7, 0.2, 0.49, 0.5, 0.9, 1.3])]
    with torch.no_grad():
        compiled = compile_graph(torch.fx.symbolic_trace(fn), inputs, {"cpu_codegen": codegen})
        for got, expected in zip(compiled(*inputs), fn(*inputs)):
            exact = {"atol": 0, "rtol": 0} if codegen == "cpp" else {}
            torch.testing.assert_close(got, expected, **exact)
    assert compiled.externs == []


@pytest.mark.parametrize("weight", [0.1, 0.49, 0.5, 0.9, 0.999, 1.7])
def test_lerp_with_a_number_weight_is_eager_bit_for_bit(weight):
    """The formula is chosen once for a number weight; 1 - w is computed in float32, as aten does."""
    def fn(start, end):
        return torch.lerp(start, end, weight)

    inputs = [torch.randn(300), torch.randn(300)]
    with torch.no_grad():
        compiled = compile_graph(torch.fx.symbolic_trace(fn), inputs, {})
        torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=0, rtol=0)


_LIBRARY = torch.library.Library("torchweld_test", "FRAGMENT")
_LIBRARY.define("scaled_and_count(Tensor x) -> (Tensor, Tensor?, SymInt, Tensor)")


def _scaled_and_count(x):
    return x * 2, None, x.shape[0], x.sum()


_LIBRARY.impl("scaled_and_count", _scaled_and_count, "CompositeExplicitAutograd")
torch.library.register_fake("torchweld_test::scaled_and_count", _scaled_and_count, lib=_LIBRARY)


_LIBRARY.define("scaled_and_stats(Tensor x) -> (Tensor, Tensor)")


def _scaled_and_stats(x):
    # its "statistics" empty, as cuDNN attention's logsumexp when not asked for (in another layout)
    return x * 2, x.new_empty(0, x.shape[0]).t()


def _scaled_and_stats_fake(x):
    return x * 2, x.new_empty(x.shape[0], 1)


_LIBRARY.impl("scaled_and_stats", _scaled_and_stats, "CompositeExplicitAutograd")
torch.library.register_fake("torchweld_test::scaled_and_stats", _scaled_and_stats_fake, lib=_LIBRARY)


def test_an_extern_result_nothing_reads_may_differ_from_its_trace():
    """cuDNN attention's meta function says its logsumexp is [b, h, s, 1]; the kernel returns it
    empty when not asked for it. The wrapper used to put every extern result into its traced
    layout (a copy into [b, h, s, 1]: a float16 GPT-2 failed on CUDA); a result nothing reads is
    left as it comes."""
    def fn(x):
        scaled, _ = torch.ops.torchweld_test.scaled_and_stats(x.t())
        return scaled + 1

    check(fn, [torch.randn(3, 5)])


def test_an_extern_returning_numbers_and_none_among_its_tensors():
    """As cuDNN attention does (its max sequence lengths): the graph compiles, readers of the
    number get the traced value, and the tensors after it keep their positions."""
    def fn(x):
        scaled, _, count, total = torch.ops.torchweld_test.scaled_and_count(x)
        return scaled + count, total * count

    x = torch.randn(5, 3)
    compiled = check(fn, [x])
    assert compiled.externs == ["torchweld_test.scaled_and_count.default"]


def test_dense_layouts_as_torch_judges_them():
    """meta_layout's own test of a dense layout (torch's took 88 us on a channels-last shape)
    agrees with torch's on permuted, sliced, expanded, size-1 and empty tensors."""
    import random

    from torch._prims_common import is_non_overlapping_and_dense_or_false

    from torchweld.compiler.lowering import non_overlapping_and_dense

    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.choice([0, 1, 1, 2, 3, 4]) for _ in range(rng.randrange(5)))
        base = torch.empty(shape)
        perm = list(range(len(shape)))
        rng.shuffle(perm)
        tensors = [base, base.permute(perm)]
        if len(shape) == 4:
            tensors.append(base.contiguous(memory_format=torch.channels_last))
        if shape and shape[0] > 1:
            tensors.append(base[::2])
        if len(shape) >= 2:
            tensors.append(torch.empty(shape[0], 1, *shape[1:]).expand(shape[0], 3, *shape[1:]))
        for t in tensors:
            assert non_overlapping_and_dense(tuple(t.shape), t.stride()) == is_non_overlapping_and_dense_or_false(t)


def test_equal_reductions_are_lowered_once():
    # var_mean decomposes into a mean and a variance that sums x again: one sum of x
    def fn(x):
        var, mean = torch.var_mean(x, dim=-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + 1e-5), x.sum(-1) + x.sum(-1)

    x = torch.randn(4, 48)
    compiled = check(fn, [x], atol=1e-5, rtol=1e-5)
    (kernel,) = compiled.schedule.kernels()
    sums = [acc for stage in kernel.stages for acc in stage.reductions]
    assert len(sums) == 2  # sum(x), then sum((x - mean)^2)


def test_equal_reductions_the_graph_returns_stay_two_tensors():
    # two outputs are two tensors, as eager returns them, not one buffer returned twice
    def fn(x):
        return x.sum(-1), x.sum(-1), x.mean(-1)

    x = torch.randn(4, 48)
    compiled = check(fn, [x], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        a, b, _ = compiled(x)
    assert a.data_ptr() != b.data_ptr()
    a.add_(1)
    torch.testing.assert_close(b, x.sum(-1), atol=1e-5, rtol=1e-5)


# -- integer division that would trap in a kernel runs as aten's ----------------------

TRAPPING_PROGRAM = r"""
import torch, torchweld
floordiv = torchweld.compile(lambda a, b: (a + 1) // b)
remainder = torchweld.compile(lambda a, b: (a + 1) % b)
floordiv_const = torchweld.compile(lambda a: (a + 0) // -1)
remainder_const = torchweld.compile(lambda a: (a + 0) % -1)
by_zero = torchweld.compile(lambda a: (a + 1) // 0)

def same_error(fn, *args):
    try:
        fn(*args)
    except RuntimeError as e:
        return str(e)
    raise AssertionError("no error")

for dtype in (torch.int64, torch.int32):
    for call in range(3):
        a = torch.arange(-5, 5, dtype=dtype) + call
        zeros = torch.zeros(10, dtype=dtype)
        for fn, eager in ((floordiv, lambda a, b: (a + 1) // b), (remainder, lambda a, b: (a + 1) % b)):
            assert same_error(fn, a, zeros) == same_error(eager, a, zeros)
        assert same_error(by_zero, a) == same_error(lambda a: (a + 1) // 0, a)
        b = torch.tensor([3, -3, 1, -1, 2, -2, 7, -7, 5, -5], dtype=dtype)
        torch.testing.assert_close(floordiv(a, b), (a + 1) // b)
        torch.testing.assert_close(remainder(a, b), (a + 1) % b)
        lowest = torch.full((10,), torch.iinfo(dtype).min, dtype=dtype)
        minus_one = torch.full((10,), -1, dtype=dtype)
        torch.testing.assert_close(floordiv(lowest - 1, minus_one), lowest // minus_one)
        torch.testing.assert_close(remainder(lowest - 1, minus_one), lowest % minus_one)
        torch.testing.assert_close(floordiv_const(lowest), lowest // -1)
        torch.testing.assert_close(remainder_const(lowest), lowest % -1)
print("ok")
"""


def test_integer_division_by_zero_raises_as_eager_and_never_kills_the_process():
    """x // 0 and x % 0 raise ZeroDivisionError as eager does, INT64_MIN // -1 wraps as eager
    does; in a C++ kernel both trapped (SIGFPE). Run in a subprocess: a regression must fail
    this test, not kill pytest."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TRAPPING_PROGRAM], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stderr[-3000:]}"
    assert done.stdout.strip().endswith("ok")


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_integer_division_by_a_tensor_or_zero_or_minus_one_is_aten(codegen):
    """Compiled only, not run: which integer divisions stay in kernels."""
    options = {"cpu_codegen": "triton"} if codegen == "triton" else None
    a, b = torch.arange(6), torch.arange(1, 7)
    from weld_helpers import weld_compile

    for fn in (lambda a, b: (a + 1) // b, lambda a, b: (a + 1) % b, lambda a, b: (a + 1) // 0 + b,
               lambda a, b: (a * 2) % -1 + b, lambda a, b: torch.div(a * 2, b, rounding_mode="floor")):
        assert weld_compile(fn, [a, b], options).externs, "a division that may trap ran in a kernel"
    if codegen == "cpp":  # (the Triton renderer has no rule for FLOORDIV and REMAINDER)
        fused = weld_compile(lambda a, b: (a + 1) // 3 + (b % -4), [a, b], options)
        assert fused.externs == []
