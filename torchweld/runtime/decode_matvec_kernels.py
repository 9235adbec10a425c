"""The Triton kernels of runtime/decode_matvec.py (which says what each computes), a module
of their own so that Triton is imported only where one runs, and so that the kernels can call
`columns_times_row` (a jitted function is found among its module's globals)."""
import triton
import triton.language as tl


@triton.jit
def columns_times_row(x, sxk, w, swn, swk, cols, col_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 sums of w's columns `cols` times the row x, walking k in BLOCK_K steps."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        wt = tl.load(w + cols[:, None] * swn + ks[None, :] * swk, mask=col_ok[:, None] & k_ok[None, :],
                     other=0.0, eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]
        xv = tl.load(x + ks * sxk, mask=k_ok, other=0.0)
        acc += tl.sum(wt.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit
def matvec_kernel(x, w, out, N, K, sxk, swk, swn, son, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = columns_times_row(x, sxk, w, swn, swk, cols, col_ok, K, BLOCK_N, BLOCK_K)
    tl.store(out + cols * son, acc.to(out.dtype.element_ty), mask=col_ok)


@triton.jit  # its own loop: both weights' rows loaded in the same step
def gated_kernel(x, wg, wu, out, N, K, sxk, sgn, sgk, sun, suk, son,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        both = col_ok[:, None] & k_ok[None, :]
        xv = tl.load(x + ks * sxk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g = tl.load(wg + cols[:, None] * sgn + ks[None, :] * sgk, mask=both, other=0.0,
                    eviction_policy="evict_first")
        acc_g += tl.sum(g.to(tl.float32) * xv, axis=1)
        u = tl.load(wu + cols[:, None] * sun + ks[None, :] * suk, mask=both, other=0.0,
                    eviction_policy="evict_first")
        acc_u += tl.sum(u.to(tl.float32) * xv, axis=1)
    dtype = out.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out + cols * son, (silu * acc_u.to(dtype).to(tl.float32)).to(dtype), mask=col_ok)


@triton.jit
def grouped_kernel(x, w0, w1, w2, w3, o0, o1, o2, o3, n0, n1, n2, n3, s0, s1, s2, s3, end0, end1, end2, K, sxk,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)  # programs [0, end0) take w0's columns, [end0, end1) w1's, ...
    if pid < end0:
        w, out, n, sn, first = w0, o0, n0, s0, 0
    elif pid < end1:
        w, out, n, sn, first = w1, o1, n1, s1, end0
    elif pid < end2:
        w, out, n, sn, first = w2, o2, n2, s2, end1
    else:
        w, out, n, sn, first = w3, o3, n3, s3, end2
    cols = (pid - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    acc = columns_times_row(x, sxk, w, sn, 1, cols, col_ok, K, BLOCK_N, BLOCK_K)
    tl.store(out + cols, acc.to(out.dtype.element_ty), mask=col_ok)
