"""A row times a matrix on CUDA: `x @ w` for x [1, k] (a decoding step's hidden state at
batch 1) and w [k, n] a linear layer's weight read across (its transpose, k contiguous in
memory).

Such a product reads every weight once and does two flops a weight: its time is the weights'
bytes over the memory bandwidth. On the H200, cuBLAS's kernels took 5.7 us for a 2048 x 512
weight and 6.0 for 2048 x 2048 (a Llama decoder's key and query projections), this one 3.0
and 4.6; on the largest (5632 x 2048, the 32000-row output layer) both come near the
bandwidth, this one 5-6% ahead (bench/investigations/matvec.py). Each program owns BLOCK_N
output columns and walks their weights along k in steps of BLOCK_K contiguous elements
(coalesced loads of weight rows), keeping BLOCK_N float32 sums; `launch_config` picks
BLOCK_N so that there are about eight programs a multiprocessor. At batch 8 cuBLAS's kernels
read the weights once for the eight rows and this one did not keep up (2-9x slower): only
one row is taken.

Registered as the custom op `torchweld::matvec` (with a Meta kernel), which weld's lowering of
aten.mm calls (compiler/rules.py) for such products in half precision in graphs that CUDA
graphs replay (launched from Python, Triton's launcher costs the host more than aten's
call). Numbers: products and sums in float32, rounded once to the result's dtype, as cuBLAS
does; the sums run in another order than cuBLAS's, so results differ from aten's by a
rounding.

`torchweld::gated_matvec(x, w_gate, w_up)` is a SwiGLU feed-forward's first half at one row,
`silu(x @ w_gate.T) * (x @ w_up.T)` (w_gate, w_up [n, k] as nn.Linear keeps them), in one
kernel: each program walks the same columns of both weights, and the product of the two
(each rounded to the dtype, silu's result too, as eager's three kernels round) is stored
instead of two products and a pointwise kernel. `torchweld::grouped_matvec(x, [w_1, ..])`
multiplies the row by two to four weights ([n_i, k]) in one kernel, each program taking one
weight's columns. passes/decode_products.py puts both in graphs (where options ask for them).
The Triton kernels are in decode_matvec_kernels.py.
"""
from __future__ import annotations

import functools

import torch

DTYPES = (torch.float16, torch.bfloat16)
# Fewer output columns than this go to aten: a program a column or more, each walking all of k,
# leaves most of the GPU idle (cuBLAS splits k); the narrowest measured, 512, was 1.9x ahead.
MIN_COLUMNS = 256


def _kernels():
    from torchweld.runtime import decode_matvec_kernels  # imports Triton: only where a kernel runs

    return decode_matvec_kernels


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether matvec takes `x @ w`: CUDA, half precision alike, one row, w read across (k's
    neighbours next to each other, so that the loads along k coalesce), and every offset the
    kernel computes within 32 bits (Triton's integer arithmetic here)."""
    return (x.is_cuda and w.is_cuda and x.dim() == 2 and w.dim() == 2 and x.dtype in DTYPES
            and w.dtype == x.dtype and x.shape[0] == 1 and x.shape[1] == w.shape[0] and w.shape[0] >= 16
            and w.shape[1] >= 1 and w.stride(0) == 1 and offsets_fit(x, w))


def offsets_fit(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the largest element offset the kernel reads at, in x or w, fits in a signed
    32-bit integer (the masked lanes past the ends read nothing)."""
    largest = max((w.shape[0] - 1) * w.stride(0) + (w.shape[1] - 1) * w.stride(1), (x.shape[1] - 1) * x.stride(1))
    return largest < 2 ** 31


def launch_config(n: int, k: int, processors: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). The H200's best per shape (bench/investigations/matvec.py):
    1024 weights of a row a step, two warps, and 1 to 4 columns a program, the most that still
    give each multiprocessor ~8 programs (fewer programs left it idle waiting on memory)."""
    block_n = 4
    while block_n > 1 and -(-n // block_n) < 8 * processors:
        block_n //= 2
    return block_n, max(16, min(1024, 1 << (k - 1).bit_length())), 2


def _processors(x: torch.Tensor) -> int:
    """The multiprocessors of x's GPU."""
    return _multiprocessors(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple[int, int, int]) -> None:
    """Run the kernel for out = x @ w (x [1, k]) with `config` (BLOCK_N, BLOCK_K, num_warps)."""
    block_n, block_k, warps = config
    k, n = w.shape
    kernel = _kernels().matvec_kernel
    kernel[(-(-n // block_n),)](x, w, out, n, k, x.stride(1), *w.stride(), out.stride(1),
                                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)


def _matvec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if not supported(x, w) or w.shape[1] < MIN_COLUMNS:  # (the lowering saw fakes): aten's product
        return torch.mm(x, w)
    out = x.new_empty((1, w.shape[1]))
    launch(x, w, out, launch_config(w.shape[1], w.shape[0], _processors(x)))
    return out


def _matvec_meta(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[1]))


def gated_supported(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """Whether gated_matvec's kernel takes these: matvec's conditions for both weights (given
    as nn.Linear keeps them, [n, k]), of one shape."""
    return (w_gate.dim() == 2 and w_gate.shape == w_up.shape
            and supported(x, w_gate.t()) and supported(x, w_up.t()))


def launch_gated(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, out: torch.Tensor,
                 config: tuple[int, int, int]) -> None:
    """Run the kernel for out = silu(x @ w_gate.T) * (x @ w_up.T) (x [1, k]) with `config`."""
    block_n, block_k, warps = config
    n, k = w_gate.shape
    kernel = _kernels().gated_kernel
    kernel[(-(-n // block_n),)](x, w_gate, w_up, out, n, k, x.stride(1), *w_gate.stride(), *w_up.stride(),
                                out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)


def _gated_matvec(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    if not gated_supported(x, w_gate, w_up) or w_gate.shape[0] < MIN_COLUMNS:  # eager's three kernels
        return torch.nn.functional.silu(x @ w_gate.t()) * (x @ w_up.t())
    out = x.new_empty((1, w_gate.shape[0]))
    launch_gated(x, w_gate, w_up, out, gated_launch_config(*w_gate.shape, _processors(x)))
    return out


def gated_launch_config(n: int, k: int, processors: int) -> tuple[int, int, int]:
    """gated_matvec's (BLOCK_N, BLOCK_K, num_warps): as many weight rows a program (BLOCK_N of
    each weight) as launch_config gives the two weights stacked into one of 2n rows."""
    block_n, block_k, warps = launch_config(2 * n, k, processors)
    return max(1, block_n // 2), block_k, warps


def _gated_matvec_meta(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w_gate.shape[0]))


MAX_GROUP = 4  # weights one grouped_matvec takes (grouped_kernel's pointers)


def grouped_supported(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether grouped_matvec's kernel takes these: 2 to MAX_GROUP weights ([n_i, k] as
    nn.Linear keeps them, each row contiguous), each as matvec would take it."""
    return (2 <= len(weights) <= MAX_GROUP and all(w.dim() == 2 and w.stride(1) == 1 for w in weights)
            and all(supported(x, w.t()) for w in weights))


def launch_grouped(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor],
                   config: tuple[int, int, int]) -> None:
    """Run the kernel for outs[i] = x @ weights[i].T (x [1, k]; outs contiguous) with `config`."""
    block_n, block_k, warps = config
    ends, total = [], 0
    for w in weights:
        total += -(-w.shape[0] // block_n)
        ends.append(total)
    pad = MAX_GROUP - len(weights)
    ws, os_ = weights + [weights[0]] * pad, outs + [outs[0]] * pad
    ns, strides = [w.shape[0] for w in ws], [w.stride(0) for w in ws]
    bounds = (ends + [total] * pad)[:MAX_GROUP - 1]
    kernel = _kernels().grouped_kernel
    kernel[(total,)](x, *ws, *os_, *ns, *strides, *bounds, x.shape[1], x.stride(1),
                     BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)


def _grouped_matvec(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    if not grouped_supported(x, weights) or sum(w.shape[0] for w in weights) < MIN_COLUMNS:  # eager's, one each
        return [x @ w.t() for w in weights]
    outs = [x.new_empty((1, w.shape[0])) for w in weights]
    launch_grouped(x, weights, outs, launch_config(sum(w.shape[0] for w in weights), x.shape[1], _processors(x)))
    return outs


def _grouped_matvec_meta(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


_LIBRARY = torch.library.Library("torchweld", "FRAGMENT")
_LIBRARY.define("matvec(Tensor x, Tensor w) -> Tensor")
_LIBRARY.impl("matvec", _matvec, "CompositeExplicitAutograd")
# A Meta kernel, which fake tensors run too (torch.library.register_fake looks up its caller's
# source, slowly where many modules are loaded: see embedding_backward.py)
_LIBRARY.impl("matvec", _matvec_meta, "Meta")
_LIBRARY.define("gated_matvec(Tensor x, Tensor w_gate, Tensor w_up) -> Tensor")
_LIBRARY.impl("gated_matvec", _gated_matvec, "CompositeExplicitAutograd")
_LIBRARY.impl("gated_matvec", _gated_matvec_meta, "Meta")
_LIBRARY.define("grouped_matvec(Tensor x, Tensor[] weights) -> Tensor[]")
_LIBRARY.impl("grouped_matvec", _grouped_matvec, "CompositeExplicitAutograd")
_LIBRARY.impl("grouped_matvec", _grouped_matvec_meta, "Meta")

matvec = torch.ops.torchweld.matvec.default
gated_matvec = torch.ops.torchweld.gated_matvec.default
grouped_matvec = torch.ops.torchweld.grouped_matvec.default
