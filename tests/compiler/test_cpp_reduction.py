"""Accurate C++ reductions (codegen/cpp_reduction.py): sums in chunks added up in double,
long rows shared by threads. Each result is compared with a float64 reference, and its error
must be within a small factor of eager's own (measured here, on the same data)."""
import pytest
import torch
import torch.nn.functional as F

from torchweld.compiler.codegen.cpp_reduction import reduced_loops
from torchweld.tuning import tuning

from weld_helpers import weld_compile

FACTOR = 4  # weld's error may be this many times eager's (or one float32 rounding, if eager's is smaller)
ROUNDING = 2.0 ** -24


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return ((got.double() - exact).abs().max() / exact.abs().max().clamp(min=1e-300)).item()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _uniform(n, seed=0):
    return torch.rand(n, generator=_generator(seed)) + 0.5


def _normal(*shape, seed=0):
    return torch.randn(*shape, generator=_generator(seed))


# (name, fn, its float64 reference, inputs)
CASES = [
    ("sum", lambda x: x.sum(), lambda x: x.sum(), lambda: [_uniform(10**7)]),
    ("sum of a product", lambda a, b: (a * b).sum(), lambda a, b: (a * b).sum(),
     lambda: [_normal(10**7, seed=1), _normal(10**7, seed=2) + 0.1]),
    ("mean of a constant", lambda x: (x * 1.0).mean(), lambda x: x.mean(), lambda: [torch.full((10**7,), 0.1)]),
    ("mean", lambda x: (x * 1.0).mean(), lambda x: x.mean(), lambda: [_uniform(3 * 10**6, seed=3)]),
    ("var", lambda x: x.var(), lambda x: x.var(), lambda: [_normal(10**7, seed=4) * 0.1 + 1000]),
    ("std", lambda x: x.std(correction=0), lambda x: x.std(correction=0), lambda: [_normal(10**6, seed=5) + 5]),
    ("norm", lambda x: torch.linalg.vector_norm(x), lambda x: torch.linalg.vector_norm(x),
     lambda: [_normal(10**7, seed=6)]),
    ("frobenius norm of rows", lambda x: x.norm(dim=1), lambda x: x.norm(dim=1), lambda: [_normal(4, 2 * 10**6, seed=7)]),
    ("mse loss", lambda a, b: F.mse_loss(a, b), lambda a, b: ((a - b) ** 2).mean(),
     lambda: [_normal(10**7, seed=8), _normal(10**7, seed=9)]),
    ("squared error mean", lambda a, b: ((a - b) ** 2).mean(), lambda a, b: ((a - b) ** 2).mean(),
     lambda: [_normal(10**6, seed=10), _normal(10**6, seed=11)]),
    ("column sums", lambda x: (x * 2.0).sum(0), lambda x: (x * 2.0).sum(0), lambda: [_uniform((10**6, 16))]),
    ("row sums", lambda x: (x * 2.0).sum(1), lambda x: (x * 2.0).sum(1), lambda: [_uniform((64, 50_000))]),
    ("sums over two dims", lambda x: x.sum((0, 2)), lambda x: x.sum((0, 2)), lambda: [_uniform((300, 3, 3000))]),
    ("short column sums", lambda x: x.sum(0), lambda x: x.sum(0), lambda: [_normal(2000, 16, seed=15)]),
    ("few long columns", lambda x: x.sum(0) * 2, lambda x: x.sum(0) * 2, lambda: [_normal(300_000, 5, seed=16)]),
    ("few long columns over two dims", lambda x: x.sum((0, 1)), lambda x: x.sum((0, 1)),
     lambda: [_normal(50_000, 3, 8, seed=17)]),
]


@pytest.mark.parametrize("name,fn,exact,make", CASES, ids=[c[0] for c in CASES])
def test_reductions_are_as_accurate_as_eager(name, fn, exact, make):
    inputs = make()
    compiled = weld_compile(fn, inputs)
    assert compiled.externs == [], compiled.externs
    reference = exact(*(x.double() for x in inputs))
    eager_error = relative_error(fn(*inputs), reference)
    for _ in range(3):  # (the same answer each call: segments combine in a fixed order)
        with torch.no_grad():
            got = compiled(*inputs)
        assert relative_error(got, reference) <= FACTOR * max(eager_error, ROUNDING), (
            f"{name}: weld's error {relative_error(got, reference):.3g}, eager's {eager_error:.3g}")
    assert torch.equal(got, compiled(*inputs))


def test_the_threaded_walk_splits_rows_into_fixed_segments():
    def kernels(fn, x):
        source = weld_compile(fn, [x]).kernel_sources["cpp"]
        return source[source.index('extern "C"'):]

    whole = kernels(lambda x: (x * 1.0).sum(), torch.ones(tuning.threaded_min))
    assert f"rseg < {tuning.segments}" in whole and "double acc" in whole
    assert "for (int64_t rseg" in kernels(lambda x: x.sum(1), torch.ones(3, tuning.threaded_min))
    many_outputs = kernels(lambda x: x.sum(1), torch.ones(64, 4 * tuning.chunk))
    assert "rseg" not in many_outputs and "for (int64_t rq" in many_outputs  # threads share the outputs; rows in chunks
    short_rows = kernels(lambda x: x.sum(1), torch.ones(64, tuning.chunk))
    assert "for (int64_t rq" not in short_rows and "double" not in short_rows  # as before: one float sum per lane


def test_few_columns_share_their_rows_across_threads():
    """A column sum of few columns (one block of a C++ outer reduction) ran on one thread:
    16 columns of 6.25e6 rows took 33 ms on 16 cores, torch.compile 4.3. Its rows now go to
    segments as a row sum's do, each block of columns summed in chunks of tuning.chunk / 16 rows."""
    x = _normal(tuning.threaded_min // 4, 5, seed=18)
    x[1000, 2] = float("nan")
    fn = lambda x: [x.sum(0), x.amax(0), x.amin(0), (x > 1).any(0)]  # noqa: E731
    compiled = weld_compile(fn, [x])
    source = compiled.kernel_sources["cpp"]
    assert "x0b" in source and f"rseg < {tuning.segments}" in source
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), fn(x), equal_nan=True)


def test_reduced_loops_cut_the_outermost_loop_whose_inner_ones_fit_a_chunk():
    assert not reduced_loops((8,), (tuning.chunk,)).chunked
    walk = reduced_loops((16,), (3, 2000, 1, 100))  # 16 outputs: threads share those
    assert [v for v, _ in walk.loops] == ["r0", "r1", "r3"]
    assert walk.loops[walk.split] == ("r1", 2000) and walk.chunk == tuning.chunk // 100 and not walk.threaded
    walk = reduced_loops((), (5 * tuning.threaded_min,))
    assert walk.split == 0 and walk.chunk == tuning.chunk and walk.threaded
    assert walk.chunks == -(-5 * tuning.threaded_min // tuning.chunk)
    columns = reduced_loops((1,), (tuning.threaded_min // 16,), lanes=16)  # an outer reduction's block of 16
    assert columns.chunk == tuning.chunk // 16 and columns.threaded


def test_max_min_nan_and_integer_sums_over_threaded_rows():
    x = _normal(3, tuning.threaded_min + 7, seed=12)
    x[1, 100_000] = float("nan")
    i = torch.randint(-1000, 1000, (tuning.threaded_min + 5,), generator=_generator(13))

    def fn(x, i):
        return x.amax(1), x.amin(1), (x > 0).any(1), (x > -10).all(1), i.sum(), (i * 3).amax(), i.prod()

    compiled = weld_compile(fn, [x, i])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, i), fn(x, i), equal_nan=True)


def test_long_float_products_run_in_double():
    """Factors near 1 round a float product the same way at every step: 300000 of them came
    out 0.2% off in float (eager's 0.16%); in double the product is the float64 one."""
    factors = 1 + _normal(300_000, seed=14) * 1e-6
    compiled = weld_compile(lambda f: (f * 1.0).prod(), [factors])
    with torch.no_grad():
        assert relative_error(compiled(factors), factors.double().prod()) < 1e-6
    assert "double acc" in compiled.kernel_sources["cpp"]
