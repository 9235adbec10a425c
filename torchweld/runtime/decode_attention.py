"""Attention for decoding on CUDA: few query rows over a long key/value cache, split along
the cache (flash-decoding).

`decode_attention(q, k, v, mask, scale)` computes softmax(q @ k^T * scale + mask) @ v for
q [b, kv, r, d] (the r query heads of a grouped-query group, one position each), k and v
[b, kv, s, d] (the cache, unrepeated), mask broadcastable to [b, kv, r, s] (bool: attend
where True; or float, added) or None. The fused attention kernels of aten give one thread
block a (batch, head) pair and walk the whole cache in it: a decoder with 8 key/value heads
at batch 1 keeps 8 of the H100's 132 multiprocessors busy (31 us a layer for 2048 positions).
Here the cache is cut into splits, each block computes its split's running maximum, sum and
weighted values in float32, and a second kernel combines the splits, so that every
multiprocessor reads its share of the cache once.

Registered as the custom op `torchweld::decode_attention` (with a fake implementation), so
that weld's aten trace records it as one extern call; passes/grouped_attention.py puts it
in inference graphs on CUDA. Numbers: scores and the softmax in float32, the probabilities
rounded to v's dtype before their product with v, as flash attention does.
"""
from __future__ import annotations

import functools

import torch

from torchweld.tuning import tuning


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q, k, v, mask, m_out, l_out, acc_out, scale, R, S, per_split, KV,
                     sqb, sqh, sqr, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                     smb, smh, smr, sms,
                     R_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr,
                     SPLITS: tl.constexpr):
        pid, split = tl.program_id(0), tl.program_id(1)
        b, h = pid // KV, pid % KV
        rows = tl.arange(0, R_PAD)
        dims = tl.arange(0, D)
        row_ok = rows < R
        qv = tl.load(q + b * sqb + h * sqh + rows[:, None] * sqr + dims[None, :] * sqd, mask=row_ok[:, None], other=0.0)
        m_i = tl.full([R_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([R_PAD], tl.float32)
        acc = tl.zeros([R_PAD, D], tl.float32)
        start = split * per_split
        end = tl.minimum(start + per_split, S)
        for s0 in range(start, end, BLOCK):
            pos = s0 + tl.arange(0, BLOCK)
            pos_ok = pos < end
            kv_ = tl.load(k + b * skb + h * skh + pos[:, None] * sks + dims[None, :] * skd, mask=pos_ok[:, None], other=0.0)
            scores = tl.dot(qv, tl.trans(kv_)).to(tl.float32) * scale
            keep = pos_ok[None, :] & row_ok[:, None]
            if MASK == 1:  # bool: attend where True
                mv = tl.load(mask + b * smb + h * smh + rows[:, None] * smr + pos[None, :] * sms, mask=keep, other=0)
                keep = keep & (mv != 0)
            if MASK == 2:  # float: added
                mv = tl.load(mask + b * smb + h * smh + rows[:, None] * smr + pos[None, :] * sms, mask=keep, other=0.0)
                scores = scores + mv.to(tl.float32)
            scores = tl.where(keep, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = tl.load(v + b * svb + h * svh + pos[:, None] * svs + dims[None, :] * svd, mask=pos_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv).to(tl.float32)
            m_i = m_new
        base = (pid * SPLITS + split) * R_PAD
        tl.store(m_out + base + rows, m_i)
        tl.store(l_out + base + rows, l_i)
        tl.store(acc_out + (base + rows[:, None]) * D + dims[None, :], acc)

    @triton.jit
    def combine_kernel(m_in, l_in, acc_in, out, KV, sob, soh, sor, sod,
                       R_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
        pid, row = tl.program_id(0), tl.program_id(1)  # one query row of one group
        b, h = pid // KV, pid % KV
        dims = tl.arange(0, D)
        at = (pid * SPLITS + tl.arange(0, SPLITS)) * R_PAD + row  # [SPLITS]
        m = tl.load(m_in + at)
        l = tl.load(l_in + at)
        m_all = tl.max(m, 0)
        w = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))
        acc = tl.load(acc_in + at[:, None] * D + dims[None, :])  # [SPLITS, D]
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(out + b * sob + h * soh + row * sor + dims * sod, o.to(out.dtype.element_ty))

    return split_kernel, combine_kernel


def splits_for(groups: int, length: int, device: torch.device) -> int:
    """How many splits of the cache: about two thread blocks a multiprocessor, each split at
    least one tuning.block_s step; a power of two (the combine kernel's range)."""
    processors = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    want = max(1, min(-(-2 * processors // groups), -(-length // tuning.block_s)))
    return 1 << (want - 1).bit_length()


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether decode_attention takes these: CUDA, a head size of 16 to 256 and a power of
    two, at most 64 query rows a group, half precision (float32 would go through TF32 dots)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dim() == 4 and d in (16, 32, 64, 128, 256) and q.shape[-2] <= 64
            and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype)


@torch.library.custom_op("torchweld::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    b, kv, r, d = q.shape
    s = k.shape[-2]
    split_kernel, combine_kernel = _kernels()
    r_pad = max(16, 1 << (r - 1).bit_length())
    splits = splits_for(b * kv, s, q.device)
    per_split = -(-s // splits)
    per_split = -(-per_split // tuning.block_s) * tuning.block_s
    m = torch.empty(b * kv * splits * r_pad, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(b * kv * splits * r_pad * d, device=q.device, dtype=torch.float32)
    out = torch.empty((b, kv, r, d), device=q.device, dtype=q.dtype)
    if mask is None:
        kind, mask_arg, mstrides = 0, q, (0, 0, 0, 0)
    else:
        mask_arg = mask.expand(b, kv, r, s)
        kind, mstrides = (1 if mask.dtype == torch.bool else 2), mask_arg.stride()
    split_kernel[(b * kv, splits)](q, k, v, mask_arg, m, l, acc, scale, r, s, per_split, kv,
                                    *q.stride(), *k.stride(), *v.stride(), *mstrides,
                                    R_PAD=r_pad, D=d, BLOCK=tuning.block_s, MASK=kind, SPLITS=splits)
    combine_kernel[(b * kv, r)](m, l, acc, out, kv, *out.stride(), R_PAD=r_pad, D=d, SPLITS=splits)
    return out


@decode_attention.register_fake
def _(q, k, v, mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
