"""A Triton matmul template (mm and bmm), the candidate max-autotune weighs
against the aten kernel: tiles of BLOCK_M x BLOCK_N, K in steps of BLOCK_K,
program ids grouped GROUP_M rows at a time so neighbouring tiles share reads."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): a small spread of tile shapes
CONFIGS = (
    (64, 64, 32, 4, 3),
    (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4),
    (128, 128, 32, 8, 3),
    (32, 32, 32, 2, 2),
)


@triton.jit
def _matmul(a_ptr, b_ptr, c_ptr, M, N, K,
            sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % size_m)
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + batch * sab + rm[:, None] * sam + rk[None, :] * sak
    b = b_ptr + batch * sbb + rk[:, None] * sbk + rn[None, :] * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a_tile = tl.load(a, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        b_tile = tl.load(b, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)
        a += BLOCK_K * sak
        b += BLOCK_K * sbk
    c = c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


class TritonMatmul:
    """aten.mm / aten.bmm through the template with one tile configuration; called like the aten op."""

    def __init__(self, config: tuple):
        self.config = tuple(config)

    def __repr__(self) -> str:
        return f"TritonMatmul{self.config}"

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        batched = a.dim() == 3
        a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
        nb, m, k = a3.shape
        n = b3.shape[2]
        c3 = torch.empty((nb, m, n), dtype=a.dtype, device=a.device)
        bm, bn, bk, warps, stages = self.config
        fp32 = a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), nb)
        _matmul[grid](a3, b3, c3, m, n, k, *a3.stride(), *b3.stride(), *c3.stride(),
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                      PRECISION="ieee" if fp32 else "tf32", num_warps=warps, num_stages=stages)
        return c3 if batched else c3[0]
