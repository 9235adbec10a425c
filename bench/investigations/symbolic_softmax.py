"""Why a softmax over a symbolic row length (BERT's attention scores, compiled over symbols) runs
3.7x slower than the kernel compiled for the length (H200, length 420: 137 us against 37), and
which kernel shape closes it: hand-written Triton variants of weld's kernel, timed at several
row lengths on rows of [96 * L, L] float32 (BERT b8's 12 heads).

    python bench/investigations/symbolic_softmax.py [--lengths 52,229,420,512]

Variants: `looped` is weld's kernel over symbols (three passes over the row in RBLOCK-wide
steps, chunks of 32 steps, sums' chunk partials in float64), at its blocks (XBLOCK 4, RBLOCK
256 from the hint 229) and wider ones; `looped_f32` the same without chunks; `online` two
passes (max and sum together, the sum rescaled as the max grows); `persistent` one block a row,
RBLOCK a constant a launch picks (the next power of two of the row: one compile per power),
the row kept in registers between passes, as weld's kernel for a known length is. The
"weld's" rows are the kernel weld generated for BERT (WELD_KERNEL, before weld decomposed
`_safe_softmax` itself), as it was and with one feature at a time removed.

Found on the H200 (2026-11-28, length 420): weld's kernel 105 us, 72 without the all-masked-row
flag (a boolean accumulator beside the max: compiler/decompositions.py's safe_softmax now reads
those rows off the max), the hand-written looped one 53, persistent 37.6 (the length's own
kernel: 37); at 52, 229 and 512 too the persistent kernel with RBLOCK 512 was fastest.
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile

import torch
import triton
import triton.language as tl


@triton.jit
def looped(ptr0, ptr1, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr, STEPS: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    acc1 = tl.full([XBLOCK, RBLOCK], float("-inf"), tl.float32)
    for rchunk in range(0, rnumel, RBLOCK * STEPS):
        for roffset in range(rchunk, tl.minimum(rchunk + RBLOCK * STEPS, rnumel), RBLOCK):
            rindex = roffset + tl.arange(0, RBLOCK)[None, :]
            xrmask = xmask & (rindex < rnumel)
            v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=0)
            acc1 = tl.where(xrmask, tl.maximum(acc1, v), acc1)
    row_max = tl.max(acc1, 1)[:, None]
    total = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    for rchunk in range(0, rnumel, RBLOCK * STEPS):
        part = tl.full([XBLOCK, RBLOCK], 0, tl.float32)
        for roffset in range(rchunk, tl.minimum(rchunk + RBLOCK * STEPS, rnumel), RBLOCK):
            rindex = roffset + tl.arange(0, RBLOCK)[None, :]
            xrmask = xmask & (rindex < rnumel)
            v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=0)
            part = tl.where(xrmask, part + tl.exp(v - row_max), part)
        total = total + part.to(tl.float64)
    row_sum = tl.sum(total, 1)[:, None].to(tl.float32)
    for rchunk in range(0, rnumel, RBLOCK * STEPS):
        for roffset in range(rchunk, tl.minimum(rchunk + RBLOCK * STEPS, rnumel), RBLOCK):
            rindex = roffset + tl.arange(0, RBLOCK)[None, :]
            xrmask = xmask & (rindex < rnumel)
            v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=0)
            tl.store(ptr1 + xindex * rnumel + rindex, tl.exp(v - row_max) / row_sum, xrmask)


@triton.jit
def looped_f32(ptr0, ptr1, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    acc1 = tl.full([XBLOCK, RBLOCK], float("-inf"), tl.float32)
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        xrmask = xmask & (rindex < rnumel)
        v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=0)
        acc1 = tl.where(xrmask, tl.maximum(acc1, v), acc1)
    row_max = tl.max(acc1, 1)[:, None]
    part = tl.full([XBLOCK, RBLOCK], 0, tl.float32)
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        xrmask = xmask & (rindex < rnumel)
        v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=0)
        part = tl.where(xrmask, part + tl.exp(v - row_max), part)
    row_sum = tl.sum(part, 1)[:, None]
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        xrmask = xmask & (rindex < rnumel)
        v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=0)
        tl.store(ptr1 + xindex * rnumel + rindex, tl.exp(v - row_max) / row_sum, xrmask)


@triton.jit
def online(ptr0, ptr1, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    m = tl.full([XBLOCK, RBLOCK], float("-inf"), tl.float32)
    s = tl.full([XBLOCK, RBLOCK], 0, tl.float32)
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        xrmask = xmask & (rindex < rnumel)
        v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=float("-inf"))
        new_m = tl.maximum(m, v)
        scale = tl.where(new_m == float("-inf"), 0.0, tl.exp(m - new_m))
        s = s * scale + tl.where(new_m == float("-inf"), 0.0, tl.exp(v - new_m))
        m = new_m
    row_max = tl.max(m, 1)[:, None]
    row_sum = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), 1)[:, None]
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        xrmask = xmask & (rindex < rnumel)
        v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=0)
        tl.store(ptr1 + xindex * rnumel + rindex, tl.exp(v - row_max) / row_sum, xrmask)


@triton.jit
def persistent(ptr0, ptr1, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    rindex = tl.arange(0, RBLOCK)[None, :]
    xrmask = xmask & (rindex < rnumel)
    v = tl.load(ptr0 + xindex * rnumel + rindex, xrmask, other=0)
    row_max = tl.max(tl.where(xrmask, v, float("-inf")), 1)[:, None]
    e = tl.where(xrmask, tl.exp(v - row_max), 0.0)
    row_sum = tl.sum(e, 1)[:, None]
    tl.store(ptr1 + xindex * rnumel + rindex, e / row_sum, xrmask)


# weld's kernel over symbols as it generated it for BERT's scores (its attention mask folded to
# `x2 >= 0`), launched with ks0 = 96 * L rows, ks1 = 12 * L, ks2 = L, ks3 = 12; and variants of it,
# each without one of its features: which one costs what the hand-written `looped` does not pay
WELD_KERNEL = '''import triton
import triton.language as tl


@triton.jit
def _tw_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tw_min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tw_max_rows(x, axis):
    return tl.reduce(x, axis, _tw_max)


@triton.jit
def _tw_min_rows(x, axis):
    return tl.reduce(x, axis, _tw_min)

@triton.jit(do_not_specialize=['ks0', 'ks1', 'ks2'])
def weld(ptr0, ptr1, ks0, ks1, ks2, ks3, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < ks0
    xq0 = xindex // ks1
    xq1 = xindex // ks2
    x2 = xindex - xq1 * ks2
    tmp3 = x2 >= 0
    tmp4 = tl.where(tmp3, 0.0, float("-inf"))
    acc1 = tl.full([XBLOCK, RBLOCK], float("-inf"), tl.float32)
    acc2 = tl.full([XBLOCK, RBLOCK], 1, tl.int1)
    for rchunk in range(0, ks2, RBLOCK * 32):
        for roffset in range(rchunk, tl.minimum(rchunk + RBLOCK * 32, ks2), RBLOCK):
            rindex = roffset + tl.arange(0, RBLOCK)[None, :]
            rmask = rindex < ks2
            xrmask = xmask & rmask
            tmp5 = tl.load(ptr0 + (((xindex * ks2) + rindex)), xrmask, other=0)
            tmp6 = tmp5 + tmp4
            acc1 = tl.where(xrmask, tl.maximum(acc1, tmp6, propagate_nan=tl.PropagateNan.ALL), acc1)
            tmp7 = tmp6 == float("-inf")
            acc2 = tl.where(xrmask, acc2 & tmp7, acc2)
    acc1 = _tw_max_rows(acc1, 1)[:, None]
    acc2 = tl.min(acc2.to(tl.int8), 1)[:, None] != 0
    acc8 = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    for rchunk in range(0, ks2, RBLOCK * 32):
        acc8p = tl.full([XBLOCK, RBLOCK], 0, tl.float32)
        for roffset in range(rchunk, tl.minimum(rchunk + RBLOCK * 32, ks2), RBLOCK):
            rindex = roffset + tl.arange(0, RBLOCK)[None, :]
            rmask = rindex < ks2
            xrmask = xmask & rmask
            tmp9 = tl.load(ptr0 + (((xindex * ks2) + rindex)), xrmask, other=0)
            tmp10 = tmp9 + tmp4
            tmp11 = tmp10 - acc1
            tmp12 = tl.exp(tmp11)
            acc8p = tl.where(xrmask, acc8p + tmp12, acc8p)
        acc8 = acc8 + acc8p.to(tl.float64)
    acc8 = tl.sum(acc8, 1)[:, None].to(tl.float32)
    tmp13 = acc2 == 0
    for rchunk in range(0, ks2, RBLOCK * 32):
        for roffset in range(rchunk, tl.minimum(rchunk + RBLOCK * 32, ks2), RBLOCK):
            rindex = roffset + tl.arange(0, RBLOCK)[None, :]
            rmask = rindex < ks2
            xrmask = xmask & rmask
            tmp14 = tl.load(ptr0 + (((xindex * ks2) + rindex)), xrmask & (tmp13), other=0)
            tmp15 = tmp14 + tmp4
            tmp16 = tmp15 - acc1
            tmp17 = tl.exp(tmp16)
            tmp18 = tmp17 / acc8
            tmp19 = tl.where(acc2, 0.0, tmp18)
            tl.store(ptr1 + (((xindex * ks2) + rindex)), tl.broadcast_to(tmp19, [XBLOCK, RBLOCK]), xrmask)
'''
WELD_VARIANTS = {
    "as generated": [],
    "no NaN-propagating max": [("tl.maximum(acc1, tmp6, propagate_nan=tl.PropagateNan.ALL)", "tl.maximum(acc1, tmp6)"),
                               ("_tw_max_rows(acc1, 1)", "tl.max(acc1, 1)")],
    "no all-masked-row flag": [("acc2 = tl.full([XBLOCK, RBLOCK], 1, tl.int1)", "acc2 = tl.full([XBLOCK, RBLOCK], 0, tl.int1)"),
                               ("acc2 = tl.where(xrmask, acc2 & tmp7, acc2)", "pass")],
    "no float64 chunk total": [("tl.float64", "tl.float32")],
    "no mask add": [('tmp4 = tl.where(tmp3, 0.0, float("-inf"))', "tmp4 = 0.0")],
    "no conditional load": [("xrmask & (tmp13)", "xrmask")],
}


def weld_variants() -> dict:
    """name -> the variant's kernel, each compiled from a file of its own (Triton reads the source)."""
    kernels = {}
    folder = tempfile.mkdtemp()
    for i, (name, edits) in enumerate(WELD_VARIANTS.items()):
        text = WELD_KERNEL
        for old, new in edits:
            assert old in text, old
            text = text.replace(old, new)
        path = f"{folder}/variant{i}.py"
        with open(path, "w") as f:
            f.write(text)
        spec = importlib.util.spec_from_file_location(f"variant{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernels[name] = module.weld
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="52,229,420,512")
    args = parser.parse_args()
    welds = weld_variants()
    for length in map(int, args.lengths.split(",")):
        rows = 96 * length
        x = torch.randn(rows, length, device="cuda")
        expected = torch.softmax(x, -1)
        out = torch.empty_like(x)
        p2 = triton.next_power_of_2(length)
        variants = {
            **{f"weld's, {name}": (lambda k: lambda: k[(triton.cdiv(rows, 4),)](x, out, rows, 12 * length, length, 12,
                                                                              4, 256))(kernel)
               for name, kernel in welds.items()},
            "looped x4 r256 (weld's)": lambda: looped[(triton.cdiv(rows, 4),)](x, out, rows, length, 4, 256, 32),
            "looped x2 r512": lambda: looped[(triton.cdiv(rows, 2),)](x, out, rows, length, 2, 512, 32),
            "looped x1 r1024": lambda: looped[(rows,)](x, out, rows, length, 1, 1024, 32),
            "looped x8 r128": lambda: looped[(triton.cdiv(rows, 8),)](x, out, rows, length, 8, 128, 32),
            "looped_f32 x4 r256": lambda: looped_f32[(triton.cdiv(rows, 4),)](x, out, rows, length, 4, 256),
            "looped_f32 x2 r512": lambda: looped_f32[(triton.cdiv(rows, 2),)](x, out, rows, length, 2, 512),
            "online x4 r256": lambda: online[(triton.cdiv(rows, 4),)](x, out, rows, length, 4, 256),
            "online x2 r512": lambda: online[(triton.cdiv(rows, 2),)](x, out, rows, length, 2, 512),
            "persistent r512 x2": lambda: persistent[(triton.cdiv(rows, 2),)](x, out, rows, length, 2, 512),
            "persistent r1024 x1": lambda: persistent[(rows,)](x, out, rows, length, 1, 1024),
            f"persistent r{p2} (next power)": lambda: persistent[(triton.cdiv(rows, max(1, 1024 // p2)),)](
                x, out, rows, length, max(1, 1024 // p2), p2),
            "looped x4 r256 8 warps": lambda: looped[(triton.cdiv(rows, 4),)](x, out, rows, length, 4, 256, 32,
                                                                              num_warps=8),
            "persistent r512 x2 8 warps": lambda: persistent[(triton.cdiv(rows, 2),)](x, out, rows, length, 2, 512,
                                                                                      num_warps=8),
        }
        ms = triton.testing.do_bench(lambda: torch.softmax(x, -1), warmup=25, rep=100)
        print(f"length {length}: rows {rows}, {x.numel() * 8 / 1e6:.1f} MB read and written once; "
              f"torch.softmax {ms * 1e3:.1f} us")
        for name, run in variants.items():
            if name.startswith("persistent r") and int(name.split()[1][1:]) < length:
                continue  # (a block narrower than the row)
            try:
                out.zero_()
                run()
                torch.cuda.synchronize()
                error = (out - expected).abs().max().item()
                ms = triton.testing.do_bench(run, warmup=25, rep=100)
                print(f"  {name:32s} {ms * 1e3:8.1f} us  max error {error:.1e}")
            except Exception as e:  # noqa: BLE001 - a variant that does not compile: say so, go on
                print(f"  {name:32s} failed: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
