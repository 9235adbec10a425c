"""C++ kernels: column reductions render as outer reductions (blocked simd over the kept dim);
Python's floor division of floats; pointwise chains rounded as eager's kernels round them."""
import pytest
import torch

from weld_helpers import check, weld_compile


def test_column_sum_is_an_outer_reduction():
    def fn(x, w):
        y = torch.erf(x) * w
        return y.sum(0), (x * y).amax(0), y.sum(0, keepdim=True) / x.shape[0] + x

    for cols in (256, 37):  # a whole number of blocks, and a ragged last block
        inputs = (torch.randn(64, cols), torch.randn(cols))
        compiled = check(fn, inputs, atol=1e-5, rtol=1e-5)
        assert "x0b" in compiled.kernel_sources["cpp"]


def test_layer_norm_weight_gradient_is_an_outer_reduction():
    """A layer norm's weight and bias gradients in an MLP's backward: column sums of terms
    that also read each row's mean and rstd. Those per-row loads repeat in the fused body,
    and counting each copy once more along the rows kept the sums inner, gathering every
    row-major load (a 64x1024 step: 0.45 ms a kernel, 0.12 ms blocked)."""
    def fn(g, x, mean, rstd, w):
        xhat = (x - mean) * rstd
        h = xhat * w
        gelu_grad = torch.exp(h * h * -0.5) * 0.4 + (torch.erf(h * 0.7) + 1) * 0.5
        dy = g * gelu_grad
        return (dy * xhat).sum(0), dy.sum(0), g.sum(0), dy

    inputs = (torch.randn(64, 256), torch.randn(64, 256), torch.randn(64, 1), torch.rand(64, 1) + 0.5,
              torch.randn(256))
    compiled = check(fn, inputs, atol=1e-4, rtol=1e-4)
    assert "x0b" in compiled.kernel_sources["cpp"]


def test_row_sum_stays_an_inner_reduction():
    inputs = (torch.randn(64, 256),)
    compiled = weld_compile(lambda x: x.sum(1), inputs)
    check(lambda x: x.sum(1), inputs, compiled=compiled)
    assert "x0b" not in compiled.kernel_sources["cpp"]


def test_outer_reduction_over_two_reduced_dims():
    fn = lambda x: x.sum((0, 1)) + x.amin((0, 1))  # noqa: E731
    check(fn, (torch.randn(8, 5, 40),), atol=1e-4, rtol=1e-5)


def test_row_max_and_min_vectorize_and_keep_nan():
    """Row max/min run under `omp simd reduction(max/min)`, which drops NaN; a per-row flag
    puts it back, as torch does (a NaN anywhere in a row makes its max and min NaN)."""
    def fn(x, i):
        return x.amax(1), x.amin(1), torch.softmax(x, dim=1), i.amax(1), i.amin(1)

    x = torch.randn(16, 200)
    x[3, 17] = float("nan")
    x[5, :] = float("-inf")
    x[7, 199] = float("inf")
    x[9, 0] = float("nan")
    inputs = (x, torch.randint(-1000, 1000, (16, 200)))
    compiled = check(fn, inputs, atol=1e-6, rtol=1e-5)
    source = compiled.kernel_sources["cpp"]
    assert "reduction(max:" in source and "reduction(min:" in source and "reduction(|:" in source


def test_a_mask_as_a_number_is_a_select():
    """A bool cast to a number renders as `m ? 1 : 0`: g++ vectorizes no loop holding a
    static_cast of a bool (a dropout mask times a tensor ran 3.5x slower)."""
    def fn(x, y):
        return [(x > 0) * y, (x > 0.5).to(torch.float16), (x < 0).to(torch.int32) + 1]

    inputs = (torch.randn(40, 33), torch.randn(40, 33))
    compiled = check(fn, inputs)
    source = compiled.kernel_sources["cpp"]
    assert "? 1.0f : 0.0f" in source and "? ((int32_t)1) : ((int32_t)0)" in source


SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5, 3.0, -3.0, 7.0, 0.1, -0.1, 1e-38, -1e-38, 1e-45, -1e-45,
           3e38, -3e38, float("inf"), float("-inf"), float("nan")]


def _same_bits(got, want):
    """Equal values, equal signs of zero, NaN where the other has NaN."""
    return bool((((got == want) & (torch.signbit(got) == torch.signbit(want))) | (got.isnan() & want.isnan())).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_floor_division_of_floats_is_pythons(dtype):
    """floor(a / b) gave 1.0 // 0.1 = 10 (eager and Python: 9), -1.0 // inf = -0.0 (-1), and
    inf // tiny = inf (NaN): the C++ helper computes it from fmod, as aten and CPython do."""
    import itertools

    pairs = list(itertools.product(SPECIAL, SPECIAL))
    a = torch.tensor([p[0] for p in pairs], dtype=dtype)
    b = torch.tensor([p[1] for p in pairs], dtype=dtype)
    fn = lambda a, b: [a // b, torch.div(a, b, rounding_mode="floor"), a // 0.1, (a * 1.0) // -3.0]  # noqa: E731
    compiled = weld_compile(fn, [a, b])
    assert compiled.externs == []
    results = compiled(a, b)
    for got, want in zip(results, fn(a, b)):
        assert _same_bits(got, want)
    assert results[0][pairs.index((1.0, 0.1))].item() == 9.0


ROUNDED_AS_EAGER = {
    "x * y + z": lambda x, y, z: x * y + z,
    "z - x * y": lambda x, y, z: z - x * y,
    "relu(x * 0.3 + y)": lambda x, y, z: torch.relu(x * 0.3 + y),
    "polynomial": lambda x, y, z: ((x * 0.1 + 0.2) * x + 0.3) * x + 0.4,
    "add alpha": lambda x, y, z: torch.add(x, y, alpha=0.3),
    "sub alpha": lambda x, y, z: torch.sub(x, y, alpha=0.3) * z + x,
    "addcmul": lambda x, y, z: torch.addcmul(x, y, z, value=0.7),
    "addcdiv": lambda x, y, z: torch.addcdiv(x, y, z.abs() + 1, value=0.7),
    "lerp small weight": lambda x, y, z: torch.lerp(x, y, 0.3),
    "lerp large weight": lambda x, y, z: torch.lerp(x, y, 0.8),
    "lerp tensor weight": lambda x, y, z: torch.lerp(x, y, z),
}


@pytest.mark.parametrize("name", list(ROUNDED_AS_EAGER))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pointwise_chains_round_as_eager_bit_for_bit(name, dtype):
    """g++ contracted `x * y + z`, two eager ops, into one fma (-ffp-contract=fast): a quarter of
    the elements differed from eager's in the last bit. Off now; the fmas eager's kernels make
    inside one op (alpha, lerp, addcmul) are explicit (Op.FMA). 37 and 1000 elements: eager's
    vectorized loop and its scalar tail."""
    import torchweld

    fn = ROUNDED_AS_EAGER[name]
    compiled = torchweld.compile(fn)
    g = torch.Generator().manual_seed(0)
    for n in (37, 1000, 1000):
        x, y, z = (torch.randn(n, generator=g, dtype=dtype) for _ in range(3))
        got, want = compiled(x, y, z), fn(x, y, z)
        assert torch.equal(got, want), f"{int((got != want).sum())} of {n} elements differ"
