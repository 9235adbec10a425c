"""What a kernel's sizes cost the GPU when they are arguments instead of literals.

    python3 bench/investigations/divide_cost.py        (CUDA)

Three memory-bound kernels of 2M float32 elements, written as weld renders them, each with
its divisors as literals ("const"), as runtime arguments with plain // and % ("runtime"),
and, for two of them, as magic numbers ("magic": a multiply-high and a shift,
compiler/codegen/size_args.py, what weld's kernels with size arguments run): a channels-last
batch norm and ReLU (x % C), a concatenation of two channels-last inputs (x // C and x % C,
each input's loads masked), and a transpose that unravels three dimensions. Microseconds
per launch (triton.testing.do_bench), for blocks of 1024 elements (4 warps) and 2048 (8).
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from torchweld.compiler.codegen.size_args import magic_division

N, C, C_A = 2097152, 128, 96  # elements; channels of the output, and of the first input of the concatenation


@triton.jit
def bn_const(x, m, s, out, n, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = i < 2097152
    c = i % 128
    v = (tl.load(x + i, mask) - tl.load(m + c, mask, eviction_policy="evict_last")) * tl.load(s + c, mask)
    tl.store(out + i, tl.maximum(v, 0.0), mask)


@triton.jit
def bn_runtime(x, m, s, out, n, channels, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = i < n
    c = i % channels
    v = (tl.load(x + i, mask) - tl.load(m + c, mask, eviction_policy="evict_last")) * tl.load(s + c, mask)
    tl.store(out + i, tl.maximum(v, 0.0), mask)


@triton.jit
def bn_magic(x, m, s, out, n, channels, magic, shift, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = i < n
    c = i - (tl.umulhi(i.to(tl.uint32), magic.to(tl.uint32)) >> shift).to(tl.int32) * channels
    v = (tl.load(x + i, mask) - tl.load(m + c, mask, eviction_policy="evict_last")) * tl.load(s + c, mask)
    tl.store(out + i, tl.maximum(v, 0.0), mask)


@triton.jit
def cat_const(a, b, out, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = i < 2097152
    row, c = i // 128, i % 128
    va = tl.load(a + (row * 96 + c), mask & (c < 96), other=0)
    vb = tl.load(b + (row * 32 + (c - 96)), mask & (c >= 96), other=0)
    tl.store(out + i, tl.where(c < 96, va, vb), mask)


@triton.jit
def cat_runtime(a, b, out, n, channels, channels_a, channels_b, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = i < n
    row, c = i // channels, i % channels
    va = tl.load(a + (row * channels_a + c), mask & (c < channels_a), other=0)
    vb = tl.load(b + (row * channels_b + (c - channels_a)), mask & (c >= channels_a), other=0)
    tl.store(out + i, tl.where(c < channels_a, va, vb), mask)


@triton.jit
def cat_magic(a, b, out, n, channels, channels_a, channels_b, magic, shift, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = i < n
    row = (tl.umulhi(i.to(tl.uint32), magic.to(tl.uint32)) >> shift).to(tl.int32)
    c = i - row * channels
    va = tl.load(a + (row * channels_a + c), mask & (c < channels_a), other=0)
    vb = tl.load(b + (row * channels_b + (c - channels_a)), mask & (c >= channels_a), other=0)
    tl.store(out + i, tl.where(c < channels_a, va, vb), mask)


@triton.jit
def transpose_const(x, out, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = i < 2097152
    x0, x1, x2 = i // 131072, (i // 128) % 1024, i % 128
    tl.store(out + i, tl.load(x + (x0 * 131072 + x2 * 1024 + x1), mask), mask)


@triton.jit
def transpose_runtime(x, out, n, a, b, c, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = i < n
    x0, x1, x2 = i // a, (i // c) % b, i % c
    tl.store(out + i, tl.load(x + (x0 * a + x2 * b + x1), mask), mask)


def main() -> None:
    x, out = torch.randn(N, device="cuda"), torch.empty(N, device="cuda")
    mean, scale = torch.randn(C, device="cuda"), torch.randn(C, device="cuda")
    a, b = torch.randn(N // C * C_A, device="cuda"), torch.randn(N // C * (C - C_A), device="cuda")
    magic, shift = magic_division(C)
    magic -= 1 << 32 if magic >= 1 << 31 else 0  # the int32 of its bits: Triton types an argument by its value
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for block, warps in ((1024, 4), (2048, 8)):
        grid = (triton.cdiv(N, block),)
        launch = {"XBLOCK": block, "num_warps": warps}
        rows = {
            "batch norm, const": lambda: bn_const[grid](x, mean, scale, out, N, **launch),
            "batch norm, runtime": lambda: bn_runtime[grid](x, mean, scale, out, N, C, **launch),
            "batch norm, magic": lambda: bn_magic[grid](x, mean, scale, out, N, C, magic, shift, **launch),
            "cat, const": lambda: cat_const[grid](a, b, out, **launch),
            "cat, runtime": lambda: cat_runtime[grid](a, b, out, N, C, C_A, C - C_A, **launch),
            "cat, magic": lambda: cat_magic[grid](a, b, out, N, C, C_A, C - C_A, magic, shift, **launch),
            "transpose, const": lambda: transpose_const[grid](x, out, **launch),
            "transpose, runtime": lambda: transpose_runtime[grid](x, out, N, 131072, 1024, 128, **launch),
        }
        for name, run in rows.items():
            print(f"XBLOCK {block:5d}  {name:22s} {do_bench(run) * 1000:8.2f} us")


if __name__ == "__main__":
    main()
