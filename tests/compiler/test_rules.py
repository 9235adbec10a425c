"""Every lowering rule against eager, over dtypes, broadcasting, odd layouts and sizes.

Many ops go into one graph per case so each case is one C++ compile."""
import pytest
import torch

from weld_helpers import check, tolerances

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def unary_float_ops(x):
    return [
        torch.abs(x), -x, torch.exp(x), torch.expm1(x), torch.log(x.abs() + 1), torch.log1p(x.abs()),
        torch.log2(x.abs() + 1), torch.sin(x), torch.cos(x), torch.tan(x), torch.tanh(x), torch.atan(x),
        torch.sqrt(x.abs()), torch.rsqrt(x.abs() + 1), torch.reciprocal(x + 10), torch.sigmoid(x), torch.erf(x),
        torch.floor(x), torch.ceil(x), torch.trunc(x), torch.round(x), torch.sign(x), torch.isnan(x),
        torch.relu(x), torch.clamp(x, -0.5, 0.5), torch.nn.functional.gelu(x), torch.nn.functional.silu(x),
        torch.nn.functional.gelu(x, approximate="tanh"), torch.nn.functional.hardtanh(x),
        torch.nn.functional.leaky_relu(x), x ** 2, x.abs() ** 1.5, x.float(), x.to(torch.int32),
    ]


def binary_ops(a, b, exact_rounding=True, floating=True):
    # floor_divide/remainder jump at integers: fusing skips eager's half-precision rounding of
    # b.abs() + 1, so they are only compared where no intermediate rounding happens
    rounding = [torch.floor_divide(a, b.abs() + 1), torch.remainder(a, b.abs() + 1)] if exact_rounding else []
    return rounding + [
        a + b, a - b, a * b, a / (b.abs() + 1), torch.maximum(a, b), torch.minimum(a, b), a < b, a <= b,
        a > b, a >= b, a == b, a != b, torch.where(a > b, a, b), a + 2 * b, torch.add(a, b, alpha=3),
        torch.atan2(a, b) if floating else a,
    ]


@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_float(dtype):
    x = (torch.randn(4, 33) * 2).to(dtype)
    atol, rtol = tolerances(dtype)
    check(lambda x: unary_float_ops(x), [x], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64])
def test_binary_broadcast(dtype):
    a = (torch.randn(3, 1, 5) * 4).to(dtype)
    b = (torch.randn(4, 1) * 4).to(dtype)
    atol, rtol = tolerances(dtype)
    exact = dtype in (torch.float32, torch.int64)
    check(lambda a, b: binary_ops(a, b, exact, dtype.is_floating_point), [a, b], atol=atol, rtol=rtol)


def test_int_and_bool_ops():
    a = torch.randint(-20, 20, (6, 7))
    b = torch.randint(1, 5, (7,))
    m = torch.rand(6, 7) > 0.5
    n = torch.rand(6, 7) > 0.3

    def fn(a, b, m, n):
        return [a + b, a * b, -a, a.abs(), a // b, a % b, a & b, a | b, a ^ b, ~a, a > 3, a.float() / b,
                m & n, m | n, m ^ n, ~m, torch.logical_and(m, n), torch.logical_not(m), torch.where(m, a, b),
                m.long() + a, a.sum(), m.sum(1), m.any(1), n.all(0), a.amax(0), a.amin(1, keepdim=True)]

    check(fn, [a, b, m, n])


def test_scalar_and_zero_dim_inputs():
    x = torch.tensor(1.5)
    y = torch.randn(3)
    check(lambda x, y: [x * 2, x + y, (x * y).sum(), torch.sin(x)], [x, y])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_reductions_every_dim(dtype):
    x = (torch.randn(3, 4, 5) * 3).to(dtype)

    def fn(x):
        outs = []
        for dim in (0, 1, 2, (0, 2), None):
            for keepdim in (False, True):
                if dtype is torch.bool:
                    outs.append(x.any(dim, keepdim=keepdim) if isinstance(dim, int) else x.any())
                    continue
                kwargs = {} if dim is None else {"dim": dim, "keepdim": keepdim}
                outs.append(x.sum(**kwargs))
                outs.append(x.amax(**kwargs) if dim is not None else x.max())
                if dtype.is_floating_point:
                    outs.append(x.mean(**kwargs))
        return outs

    atol, rtol = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}.get(dtype, (None, None))
    check(fn, [x], atol=atol, rtol=rtol)


def test_var_softmax_layernorm_functions():
    x = torch.randn(4, 6, 10)
    w, b = torch.randn(10), torch.randn(10)

    def fn(x, w, b):
        return [x.var(-1), x.var(0, unbiased=False), torch.softmax(x, -1), torch.softmax(x, 0),
                torch.log_softmax(x, 1), torch.nn.functional.layer_norm(x, (10,), w, b), x.std(1),
                torch.logsumexp(x, -1), x.norm(dim=-1), x.prod(1)]

    check(fn, [x, w, b], atol=1e-4, rtol=1e-4)


def test_non_contiguous_inputs():
    base = torch.randn(8, 6)
    t = base.t()  # transposed
    s = base[1::2, 1:5]  # sliced with a step and an offset
    e = torch.randn(6, 1).expand(6, 8)  # expanded (stride 0)

    def fn(t, s, e):
        return [t * 2, torch.sin(t) + e, s.sum(1), s.exp(), t.sum(0), (t + e).amax(1)]

    check(fn, [t, s, e])


def test_views():
    x = torch.randn(2, 3, 4, 5)

    def fn(x):
        return [
            x.permute(0, 2, 1, 3) + 1, x.transpose(1, 3).reshape(2, -1) * 2, x.reshape(6, 20).sum(1),
            x.view(2, 60)[:, 10:20].exp(), x[:, 1] * 3, x.unsqueeze(2).expand(2, 3, 7, 4, 5) + 1,
            x.flatten(1).t().contiguous(), x[..., ::2].cos(), x.squeeze(0).sin(), torch.cat([x, x * 2], 2),
            torch.stack([x[0], x[1]], 0) + 1, torch.nn.functional.pad(x, (1, 2)) * 1, x.transpose(0, 1),
            x.chunk(2, 3)[1] + 1, x.split([1, 2], 1)[1].sin(), x.unbind(1)[2] * 2,
        ]

    check(fn, [x])


def test_views_through_size_one_dims_keep_every_index():
    """Swin's window reverse: a transpose of a size-1 dim, made contiguous and viewed back.
    Substituting the reshape's index (d1 -> 0, d2 -> d1) simplified `0 * 4 + d1` to d1 and then
    substituted that d1 again, so the kernel read every window from the first one."""
    y = torch.arange(16.0).view(8, 2)

    def fn(y):
        return y.view(2, 4, 2).view(2, 1, 1, 4, 2).transpose(2, 3).contiguous().view(2, 4, 2) + 1

    check(fn, [y])


def test_a_substitution_is_not_applied_twice():
    from torchweld.compiler import ir

    d = ir.dim_vars(3)
    e = ir.iadd(ir.imul(d[1], ir.const(4)), d[2])  # 4 * d1 + d2
    assert str(ir.substitute(e, [d[0], ir.const(0), ir.dim_vars(3)[1]])) == "d1"  # at (d0, 0, d1)


def test_zero_size_and_size_one_dims():
    x = torch.randn(0, 4)
    y = torch.randn(1, 4, 1)

    def fn(x, y):
        return [x.sin(), x.sum(0), x.sum(1), y * 2, y.sum(1), y.sum(), x + 1, (y + 1).squeeze()]

    check(fn, [x, y])


def test_creation_ops():
    x = torch.randn(3, 4)

    def fn(x):
        return [torch.zeros_like(x) + 1, torch.ones(3, 4) * x, torch.full((3, 4), 2.5) + x,
                torch.arange(4) * x, torch.arange(2, 10, 2).float(), x.new_zeros(2, 2), x * 0]

    check(fn, [x])


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_clamps_keep_negative_zero_and_nan(codegen):
    """A bound replaces a value only past it, as eager clamps: relu(-0.0) is -0.0 (a maximum
    with 0.0 made it +0.0), and NaN stays NaN."""
    import os

    from weld_helpers import weld_compile

    if codegen == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path runs on CPU through the interpreter")
    x = torch.tensor([-0.0, 0.0, float("nan"), -2.0, 2.0, float("inf"), float("-inf"), 0.5] * 4)
    fn = lambda x: [torch.relu(x), x.clamp(min=0), x.clamp(max=0), x.clamp(-1, 1), torch.nn.functional.hardtanh(x),  # noqa: E731
                    torch.nn.functional.relu6(x), x.clamp(min=-0.0)]
    compiled = weld_compile(fn, [x], {"cpu_codegen": "triton"} if codegen == "triton" else None)
    for got, want in zip(compiled(x), fn(x)):
        torch.testing.assert_close(got, want, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)
