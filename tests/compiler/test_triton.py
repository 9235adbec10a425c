"""The Triton renderer, run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1)."""
import os
import re

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before triton is imported.

import pytest  # noqa: E402
import torch  # noqa: E402

from weld_helpers import check, weld_compile  # noqa: E402

triton = pytest.importorskip("triton")

TRITON = {"cpu_codegen": "triton"}


@pytest.fixture(autouse=True)
def interpret():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton's interpreter on CPU tensors; a CUDA machine runs the real kernels instead")


def test_pointwise_chain_and_broadcast():
    def fn(a, b):
        t = torch.sin(a) * 1.5 + b
        t = torch.tanh(t) - torch.exp(-t.abs())
        return [torch.sigmoid(t) * t, torch.where(a > b, a, b), (a < 0) | (b > 0), a.t() * 2]

    c = check(fn, [torch.randn(5, 7), torch.randn(7)], options=TRITON)
    assert "@triton.jit" in c.kernel_sources["triton"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    x = torch.randn(4, 9).to(dtype)
    atol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype)
    check(lambda x: [x * 2 + 1, x.sum(1), x.relu(), x.float().exp()], [x], options=TRITON,
          atol=atol, rtol=atol)


def test_int_bool():
    a, m = torch.randint(-9, 9, (3, 5)), torch.rand(3, 5) > 0.5
    check(lambda a, m: [a * 3 - 1, a.sum(0), m & (a > 0), m.any(1), a.amax(1)], [a, m], options=TRITON)


def test_reductions_one_block_and_looped():
    small, big = torch.randn(6, 40), torch.randn(3, 5000)  # 40 fits one block; 5000 loops over blocks
    check(lambda s, b: [torch.softmax(s, -1), s.sum(0), b.sum(1), b.amax(1, keepdim=True) - b,
                        torch.nn.functional.layer_norm(b, (5000,))], [small, big], options=TRITON,
          atol=1e-4, rtol=1e-4)


def test_pow_of_a_tensor_base_like_torch():
    """pow of any float base without libdevice (Adam's bias corrections when its betas are
    tensors): negative bases to integer and fractional powers, zeros, infinities and NaN."""
    specials = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, float("inf"), float("-inf"), float("nan"), 0.5, -0.5]
    exponents = [0.0, 1.0, 2.0, 3.0, -1.0, -3.0, 0.5, -0.5, 2.5, float("inf"), float("-inf"), float("nan")]
    base = torch.tensor(specials).repeat_interleave(len(exponents))
    exponent = torch.tensor(exponents).repeat(len(specials))
    c = check(lambda a, b, x: [torch.pow(a, b), torch.pow(x.abs() + 0.5, b), torch.pow(0.9, b), a ** 3.5],
              [base, exponent, torch.randn(base.shape)], options=TRITON)
    assert c.externs == []
    assert "_tw_pow(" in c.kernel_sources["triton"]


def test_max_and_min_propagate_nan_like_torch():
    """tl.maximum and tl.max return the other operand of a NaN by default; torch's
    maximum, relu, clamp, amax and amin return NaN."""
    small, big = torch.randn(4, 40), torch.randn(2, 5000)
    small[1, 3] = big[0, 4321] = float("nan")
    check(lambda s, b: [s.relu(), torch.maximum(s, -s), s.clamp(-0.5, 0.5), s.amax(1), s.amin(0),
                        b.amax(1), b.amin(1)], [small, big], options=TRITON)


def test_non_contiguous_zero_size_zero_dim():
    base = torch.randn(6, 8)
    check(lambda t, e, z, s: [t + 1, t.sum(1), e * 2, z.sum(0), s * 3],
          [base.t(), torch.randn(4, 1).expand(4, 3), torch.randn(0, 3), torch.tensor(2.0)], options=TRITON)


def test_ops_triton_lacks_become_extern():
    a, b = torch.randint(-9, 9, (4,)), torch.randint(1, 5, (4,))
    c = check(lambda a, b: a // b, [a, b], options=TRITON)
    assert c.externs == ["aten.floor_divide.default"]


def test_contiguous_accesses_read_xindex_without_div_mod():
    c = check(lambda a, b, bias: [torch.relu(a + b), a * bias[:, None, None]],
              [torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5), torch.randn(3)], options=TRITON)
    src = c.kernel_sources["triton"]
    assert "tl.load(ptr0 + (xindex)" in src and "tl.store(ptr3 + (xindex)" in src
    assert "eviction_policy='evict_last'" in src  # bias[:, None, None]: each element read 4 * 5 times
    assert src.count("//") == 1  # only the bias's channel index x1 is unravelled


def test_transposed_and_offset_accesses_still_right():
    base = torch.randn(6, 8)
    c = check(lambda t, s: [t * 2, s + 1, t.sum(1)], [base.t(), base[1:, 2:]], options=TRITON)
    assert "//" in c.kernel_sources["triton"]  # a transposed read cannot be coalesced


def test_big_pointwise_launch_and_int64_choice():
    from torchweld.compiler.codegen.triton import launch_config, needs_int64
    from torchweld.compiler.schedule import Kernel

    def kernel(n):
        return Kernel("k", torch.device("cpu"), (n,), (), (), (), (), (), ())

    # one block size at every size (size-generic kernels share it), Triton's default warps
    assert launch_config(kernel(1 << 26)) == launch_config(kernel(100)) == {"XBLOCK": 1024, "RBLOCK": 1}
    assert needs_int64(kernel(1 << 31)) and not needs_int64(kernel(1 << 26))


def test_row_kernels_drawing_random_numbers_take_eight_warps():
    """Philox is unrolled for each element a thread holds: a dropout + residual + layer norm
    row kernel takes 8 warps (4 elements a thread), the same rows without the draw 4."""
    from torchweld.compiler.codegen.triton import draws_random, launch_config

    def rows(p):
        fn = lambda x, r: torch.nn.functional.layer_norm(torch.nn.functional.dropout(x, p, training=True) + r, (768,))  # noqa: E731
        c = weld_compile(fn, [torch.randn(16, 768), torch.randn(16, 768)], TRITON)
        return [(draws_random(k), launch_config(k).get("num_warps", 4)) for k in c.schedule.kernels() if k.is_reduction]

    assert rows(0.1) == [(True, 8)]
    assert rows(0.0) == [(False, 4)]  # p=0: no draw


def test_the_largest_kernels_are_rendered_and_compiled_first():
    """A graph's first call waits for its slowest Triton compile, so kernels are rendered and
    handed to the compilers largest first, a Philox draw weighing as its unrolled rounds; the
    wrapper still launches them in the graph's order, and results equal eager's."""
    from torchweld.compiler.codegen.triton_launches import compile_order

    def fn(a, b):
        small = a + 1
        large = torch.nn.functional.layer_norm((b.sin() * b.cos() + b.exp()).tanh(), (64,))
        return small, large

    compiled = check(fn, [torch.randn(5, 7), torch.randn(8, 64)], options=TRITON)  # apart: two kernels
    kernels = compiled.schedule.kernels()
    assert [k.is_reduction for k in kernels] == [False, True]  # the graph's order: the add first
    assert [k.is_reduction for k in compile_order(kernels)] == [True, False]
    src = compiled.kernel_sources["triton"]
    assert src.index("tl.sum") < src.index("+ 1.0")  # rendered in that order too
    small, large = (f"_k_{k.name}" for k in kernels)
    assert compiled.wrapper_source.index(small) < compiled.wrapper_source.index(large)  # launched in the graph's

    drop = lambda x, r: (x + 1, torch.nn.functional.dropout(r, 0.1, training=True) * 2)  # noqa: E731
    kernels = weld_compile(drop, [torch.randn(5, 7), torch.randn(8, 64)], TRITON).schedule.kernels()
    ordered = compile_order(kernels)
    assert len(kernels) == 2 and ordered == kernels[::-1]  # one draw outweighs an add


def test_contiguous_pointwise_kernels_of_any_size_are_one_kernel():
    """A kernel whose accesses all read xindex takes its element count as an argument,
    so the same update of tensors of different sizes is one function, compiled once."""
    def fn(a, b, c, bias):
        return [torch.sigmoid(a) * 2, torch.sigmoid(b) * 2, torch.sigmoid(c) * 2, c + bias]

    inputs = [torch.randn(100), torch.randn(3, 37), torch.randn(5, 16), torch.randn(16)]
    compiled = check(fn, inputs, options=TRITON)
    src = compiled.kernel_sources["triton"]
    assert "xmask = xindex < xnumel" in src
    kernels = re.findall(r"def (k_\w+)\((.*)\):", src)
    generic = [name for name, params in kernels if "xnumel" in params]
    assert len(generic) == 1, src  # the three sigmoids share one function
    assert len(kernels) == 2  # c + bias reads bias broadcast (x1): its own kernel, sizes in its source


def test_cat_reads_each_element_from_one_input():
    """Each input's loads are masked by the condition that selects it, so a cat of n
    inputs reads one input per element, not n."""
    def fn(a, b, c):
        return torch.cat([a.relu(), b, c * 2], 1).sigmoid()

    inputs = [torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 1, 4)]
    compiled = check(fn, inputs, options=TRITON)
    loads = [line for line in compiled.kernel_sources["triton"].splitlines() if "tl.load(" in line]
    assert len(loads) == 3 and all("xmask & (" in line for line in loads)


def test_where_keeps_a_load_its_condition_needs_unmasked():
    compiled = check(lambda a: torch.where(a > 0, a, a * 0.1), [torch.randn(5, 6)], options=TRITON)
    assert compiled.kernel_sources["triton"].count("tl.load(") == 1


def test_channels_last_kernel_iterates_in_memory_order():
    """A pointwise kernel over a channels-last tensor walks it channel-fastest: its
    loads and stores are contiguous (xindex), not strided by the channel count."""
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    compiled = check(lambda a, b: (a * 2 + b).relu(), [x, torch.randn(3, 1, 1)], options=TRITON)
    source = compiled.kernel_sources["triton"]
    assert "tl.load(ptr0 + (xindex)" in source and "tl.store(ptr2 + (xindex)" in source


def test_constant_fill_is_stored():
    """A kernel that only stores a constant (zeros in a backward) gets a block, not a literal."""
    compiled = check(lambda a: [torch.zeros_like(a), a * 2], [torch.randn(3, 5)], options=TRITON)
    assert "tl.full([XBLOCK]" in compiled.kernel_sources["triton"]


def test_column_sums_split_from_fewer_elements_than_row_sums():
    """GPT-2's bias and layer-norm weight gradients (768 column sums over 2048 rows) split;
    the same number of elements summed along rows stays one step (a program per 4 rows)."""
    from torchweld.compiler.ir import Op
    from torchweld.compiler.lowering import split_plan

    assert split_plan((2048, 768), (0,), Op.SUM, True) == (0, 16)
    assert split_plan((768, 2048), (1,), Op.SUM, False) is None
    assert split_plan((1024, 256), (0,), Op.SUM, True) is None  # 256K elements: one step


def test_few_outputs_long_rows_reduce_in_two_steps(monkeypatch):
    """Batch norm's training statistics (per-channel sums over N, H, W of channels-last
    activations), a layer norm's weight gradient (per-column sums) and a whole-tensor sum:
    few outputs and long rows reduce in two steps (lowering.split_plan), so that many
    programs share the work; results equal eager's."""
    from torchweld.compiler.lowering import split_plan
    from torchweld.compiler.ir import Op
    from torchweld.tuning import tuning

    monkeypatch.setattr(tuning, "split_min_elements", 1 << 18)  # the interpreter's shapes stay small
    monkeypatch.setattr(tuning, "split_min_elements_across", 1 << 18)
    # 64 channels, rows of 16*32*32: 128 partial results, from all of N and 8 slices of H
    assert split_plan((16, 64, 32, 32), (0, 2, 3), Op.SUM, True) == (2, 8)
    assert split_plan((2048, 768), (0,), Op.SUM, True) == (0, 16)  # rows of 128 at least
    assert split_plan((8, 256, 768), (0, 1, 2), Op.SUM, False) == (1, 256)  # 2048 rows of 768
    assert split_plan((8, 4096, 8, 8), (0, 2, 3), Op.SUM, False) is None  # many outputs already
    assert split_plan((64, 64), (0,), Op.SUM, True) is None  # too small to be worth a launch
    assert split_plan((16, 64, 32, 32), (0, 2, 3), Op.PROD, True) is None
    x = torch.randn(16, 8, 48, 48).contiguous(memory_format=torch.channels_last)
    g = torch.randn(16, 8, 48, 48)

    def bn_stats_and_backward(x, g):
        mean = x.mean((0, 2, 3), keepdim=True)
        var = x.var((0, 2, 3), keepdim=True, unbiased=False)
        return [mean, var, (g * (x - mean)).sum((0, 2, 3)), x.amax((0, 2, 3)), g - g.sum((0, 2, 3), keepdim=True)]

    c = check(bn_stats_and_backward, [x, g], options=TRITON, atol=1e-3, rtol=1e-4)
    assert len(c.schedule.kernels()) > len(check(bn_stats_and_backward, [x, g], atol=1e-3, rtol=1e-4,
                                                 options={**TRITON, "split_reductions": False}).schedule.kernels())
    h, w = torch.randn(2048, 160), torch.randn(160)
    columns_and_all = lambda h, w: [(h * w).sum(0), h.sum(), h.amin(0)]  # noqa: E731
    c = check(columns_and_all, [h, w], options=TRITON, atol=1e-3, rtol=1e-4)
    assert len(c.schedule.kernels()) > len(check(columns_and_all, [h, w], atol=1e-3, rtol=1e-4,
                                                 options={**TRITON, "split_reductions": False}).schedule.kernels())


def test_reductions_read_across_rows_take_wide_blocks():
    """A reduction whose loads are contiguous along its outputs (channels-last batch norm
    statistics, column sums) is told apart from one whose rows are contiguous; it takes
    blocks of 8 to 64 outputs side by side."""
    from torchweld.compiler.codegen.triton import block_sizes, reads_across_rows

    nchw = torch.randn(4, 96, 9, 9)  # 31104 elements: one step
    nhwc = nchw.contiguous(memory_format=torch.channels_last)
    for fn, x, across in [(lambda x: x.sum((0, 2, 3)), nhwc, True), (lambda x: x.sum((0, 2, 3)), nchw, False),
                          (lambda x: x.sum(1), nhwc, False), (lambda x: x.sum(1), nchw, True)]:
        c = check(fn, [x], options=TRITON, atol=1e-4, rtol=1e-4)
        [kernel] = [k for k in c.schedule.kernels() if k.is_reduction]
        assert reads_across_rows(kernel) is across
        xblock, rblock = block_sizes(kernel)
        assert xblock * rblock <= 4096 and (xblock >= 8 or not across)
    # The same column sums of 1024 rows, read across (row-major) and along (column-major):
    # across, a block takes more outputs side by side and a shorter stretch of each row.
    rows = torch.randn(1024, 256)
    blocks = {}
    for name, x in [("across", rows), ("along", rows.t().contiguous().t())]:
        c = check(lambda x: x.sum(0), [x], options=TRITON, atol=1e-3, rtol=1e-4)
        [kernel] = c.schedule.kernels()
        blocks[name] = block_sizes(kernel)
    assert blocks["across"][0] > blocks["along"][0] and blocks["across"][1] < blocks["along"][1], blocks


def test_row_reductions_take_about_1024_elements_a_block():
    """Whole rows a block, as many as make ~1024 elements: one row of 768 (padded to 1024),
    eight of 100 (padded to 128). Four rows of 768 a block ran GPT-2's layer norms slower."""
    from torchweld.compiler.codegen.triton import block_sizes

    for width, expected in ((768, (1, 1024)), (100, (8, 128))):
        x = torch.randn(64, width)
        c = check(lambda x: torch.nn.functional.layer_norm(x, (width,)), [x], options=TRITON, atol=1e-5, rtol=1e-5)
        [kernel] = [k for k in c.schedule.kernels() if k.is_reduction]
        assert block_sizes(kernel) == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_constants_fold_into_literals(dtype):
    """A constant buffer (full) read under a cast used to render `(-65504.0).to(tl.float16)`,
    which Triton rejects: a float16 GPT-2's attention mask on CUDA. The cast is folded, rounded
    to the half type as torch rounds it (0.1 is not exact in either)."""
    x = torch.randn(4, 8).to(dtype)
    atol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    low = torch.finfo(dtype).min  # (dtype=x.dtype: a full that depends on the input, not a folded constant)
    check(lambda x: [x + torch.full((4, 8), low, dtype=x.dtype), x * torch.full((8,), 0.1, dtype=x.dtype),
                     torch.full((4, 8), 0.1, dtype=x.dtype).float() + x.float()],
          [x], options=TRITON, atol=atol, rtol=atol)


def test_zero_dim_inputs_load_as_scalars():
    """A 0-d input (Adam's step and betas) loads once a program as a scalar, unmasked, and
    what computes with it alone runs on that scalar; a where on it alone masks no load."""
    def fn(p, g, beta, step, w):
        correction = 1 - beta ** step
        return [p - 0.1 * g / correction, torch.lerp(p, g, w)]

    inputs = [torch.randn(5, 7), torch.randn(5, 7), torch.tensor(0.9), torch.tensor(3.0), torch.tensor(0.7)]
    compiled = check(fn, inputs, options=TRITON)
    src = compiled.kernel_sources["triton"]
    scalar_loads = re.findall(r"tl\.load\(ptr\d+ \+ \(0\)\)", src)
    assert len(scalar_loads) == 3, src
    assert "xmask & (" not in src  # lerp's where on its scalar weight reads both ends unmasked


def test_kernels_that_differ_only_in_sizes_share_one_function():
    """A kernel that differs from two earlier ones only in its integers (a dense block's
    layers, each with more channels) takes them as arguments, its divisions by magic number,
    so the later ones of its family are one function; the first two, handed over before the
    others are rendered, keep their literals, as does a kernel no other resembles. Results
    equal eager's."""
    from torchweld.tuning import tuning

    channels = (3, 6, 7, 11, 13)

    def fn(d, a, b, c, e, f, ma, mb, mc, me, mf):
        xs, means = (a, b, c, e, f), (ma, mb, mc, me, mf)
        return [*((x - m).relu() for x, m in zip(xs, means)), *(torch.cat([a, x], 1) for x in xs[1:]), d.t() * 2]

    # over 1024 elements each: kernels of fewer take blocks of their size, a launch of its own
    inputs = [torch.randn(8, c, 64) for c in channels] + [torch.randn(c, 1) for c in channels]
    compiled = check(fn, [torch.randn(6, 9), *inputs], options=TRITON)
    src = compiled.kernel_sources["triton"]
    kernels = re.findall(r"def (k_\w+)\((.*)\):", src)
    with_sizes = [name for name, params in kernels if "ks0" in params]
    assert len(with_sizes) == 2, src  # the later relus are one function, the later cats another
    assert "_tw_divide(xindex, kd0)" in src
    assert "@triton.jit(do_not_specialize=['kd0'" in src  # a magic number's divisibility splits no compile
    assert len(kernels) == 2 * tuning.literal_family_members + 3  # the first relus and cats, d.t() * 2: literals


def test_reductions_that_differ_only_in_sizes_share_one_function():
    """Reductions of one family (column sums of tensors with more and more columns, rows
    long enough to loop) take their sizes as arguments from the third on: the row's
    unravelling divides by magic number too. Results equal eager's."""
    widths = (3, 5, 6, 7, 9)

    def fn(a, b, c, d, e):
        return [t.sum(dim=(0, 2)) for t in (a, b, c, d, e)] + [(t * t).sum(dim=1) for t in (a, b, c, d, e)]

    inputs = [torch.randn(40, w, 70) for w in widths]  # rows of 2800: looped
    compiled = check(fn, inputs, options=TRITON, atol=1e-4, rtol=1e-4)
    src = compiled.kernel_sources["triton"]
    assert "_tw_divide(rindex" in src, src  # the column sums unravel their rows by magic number
    shared = [name for name, params in re.findall(r"def (k_\w+)\((.*)\):", src) if "ks0" in params]
    assert len(shared) == 2  # one function for the later column sums, one for the later row sums


def test_output_stored_over_the_convolution_it_reads_last():
    def fn(x, w, scale, shift):
        y = torch.nn.functional.conv2d(x, w, padding=1)
        return torch.relu(y * scale[:, None, None] + shift[:, None, None])

    c = check(fn, [torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4), torch.randn(4)],
              options=TRITON)
    assert len(c.schedule.stored_over) == 1  # the batch norm and ReLU write over the convolution's output


# -- accuracy: looped sums in chunks, var about a shift, tanh without cancellation -----


def _relative_error(got, exact):
    exact = exact.double()
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


def test_long_sums_are_as_accurate_as_eager():
    """One running sum per lane over a row of 1.2M (1172 adds a lane) was 20x further from
    the float64 sum than eager's; a row in chunks of sqrt(steps) steps is within eager's."""
    n = 1_200_000
    fns = [lambda x: (x * 1.0).mean(), lambda x: x.var()]
    for fn, x in zip(fns, [torch.full((n,), 0.1), torch.randn(n, generator=torch.Generator().manual_seed(0)) + 100]):
        compiled = weld_compile(fn, [x], TRITON)
        exact = fn(x.double())
        assert _relative_error(compiled(x), exact) <= 4 * max(_relative_error(fn(x), exact), 2.0 ** -24)
        assert "for rchunk in range(" in compiled.kernel_sources["triton"]


def test_var_of_large_equal_values_is_zero():
    """var([1e38] * 4) summed x into inf before the mean; about the row's first element it is 0."""
    x = torch.full((4,), 1e38)
    for options in (TRITON, None):
        compiled = weld_compile(lambda x: [x.var(), x.std(), x.view(2, 2).var(1), x.view(4, 1).var(0)], [x], options)
        torch.testing.assert_close(compiled(x), [torch.tensor(0.0), torch.tensor(0.0), torch.zeros(2), torch.zeros(1)])


def test_tanh_keeps_small_values_and_the_sign_of_zero():
    """2 * sigmoid(2x) - 1 cancelled: tanh(1e-7) was 0, tanh(-0.0) was +0.0."""
    x = torch.cat([torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")]),
                   torch.logspace(-38, 1, 500), -torch.logspace(-38, 1, 500), torch.linspace(-12, 12, 1001)])
    compiled = weld_compile(lambda x: torch.tanh(x * 1.0), [x], TRITON)
    got, want = compiled(x), torch.tanh(x)
    torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=4e-7)
    assert torch.equal(torch.signbit(got[:2]), torch.signbit(want[:2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safe_softmax_finds_masked_rows_from_their_max(dtype):
    """scaled_dot_product_attention's masked softmax: rows of -inf alone are zeros, a row with
    a NaN is NaN, as eager's; the masked rows are found from the row's max, with no boolean
    accumulator beside it (which made BERT's softmax over a symbolic length 1.5x slower)."""
    scores = torch.randn(2, 3, 5, 7)
    scores[:, :, 1] = float("-inf")
    scores[0, 1, 2, 3] = float("nan")
    scores[1, 2, 4, :5] = float("-inf")
    scores = scores.to(dtype)
    tolerance = 2e-2 if dtype is torch.bfloat16 else None
    compiled = check(lambda s: torch.ops.aten._safe_softmax(s, -1), [scores], options=TRITON,
                     atol=tolerance, rtol=tolerance)
    source = compiled.kernel_sources["triton"]
    assert compiled.externs == [] and "tl.int1" not in source, source
