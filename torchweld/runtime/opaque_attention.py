"""`torchweld::attention`: scaled_dot_product_attention as one opaque op, for inference traces
over symbolic sizes.

Over symbols, the aten trace runs scaled_dot_product_attention under the Python dispatcher
(compiler/aten_trace.py, `_CompositesOverSymbols`): on CUDA, a mask the memory-efficient kernel
cannot take as it is (BERT's, broadcast over heads, its rows not a multiple of 8) sends it down
the math path, decomposed into matmuls and a softmax that weld then compiles as kernels of
its own: more Triton kernels to compile over symbols, and a softmax over a symbolic length
that ran ~3% slower than the fused kernel (BERT, H200). Recorded as this op instead, the call
is one extern that runs `F.scaled_dot_product_attention` on the real tensors, which picks the
kernel for their sizes as eager would, with eager's numbers.

The result is laid out as the fused CUDA kernels lay theirs out, dense in (batch, position,
head, feature) order, so that the `transpose(1, 2).reshape(b, s, h * d)` after attention is a
view; a kernel that returns another layout (the math path) is copied into it.

Only where tuning.opaque_attention_over_symbols asks (off until timed on a GPU) and `applies`
says: 4-d query, key and value on CUDA, no dropout, nothing that requires grad (training keeps
aten's differentiable decomposition), a scale that is a number or None.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def applies(args: tuple, kwargs: dict) -> bool:
    """Whether a scaled_dot_product_attention call with these arguments is recorded as the op."""
    bound = bind(args, kwargs)
    if bound is None:
        return False
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
    tensors = [q, k, v] + ([mask] if mask is not None else [])
    return (all(isinstance(t, torch.Tensor) for t in tensors) and q.dim() == k.dim() == v.dim() == 4
            and all(on_attention_device(t) for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and isinstance(bound["dropout_p"], (int, float)) and bound["dropout_p"] == 0
            and isinstance(bound["is_causal"], bool) and isinstance(bound["enable_gqa"], bool)
            and (bound["scale"] is None or isinstance(bound["scale"], (int, float))))


def on_attention_device(t: torch.Tensor) -> bool:
    """Whether `t` is where the op replaces aten's trace (CUDA; tests let the CPU through)."""
    return t.is_cuda


def bind(args: tuple, kwargs: dict) -> dict | None:
    """F.scaled_dot_product_attention's arguments by name, defaults filled; None for others."""
    if len(args) > len(_NAMES) or set(kwargs) - set(_NAMES):
        return None
    bound = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound.update(zip(_NAMES, args))
    bound.update(kwargs)
    return bound if {"query", "key", "value"} <= set(bound) else None


def call(args: tuple, kwargs: dict) -> torch.Tensor:
    """The op on arguments `applies` accepted."""
    b = bind(args, kwargs)
    scale = None if b["scale"] is None else float(b["scale"])
    return attention(b["query"], b["key"], b["value"], b["attn_mask"], b["is_causal"], scale, b["enable_gqa"])


def _strides(shape) -> tuple:
    """Dense strides of a (batch, heads, positions, features) result laid out position-major."""
    batch, heads, positions, features = shape
    return (positions * heads * features, features, heads * features, 1)


def _attention(q, k, v, mask, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    strides = _strides(out.shape)
    if out.stride() == strides:
        return out
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device).copy_(out)


def _attention_meta(q, k, v, mask, is_causal, scale, enable_gqa):
    shape = (*q.shape[:-1], v.shape[-1])
    return q.new_empty_strided(shape, _strides(shape))


_LIBRARY = torch.library.Library("torchweld", "FRAGMENT")
_LIBRARY.define("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float? scale, "
                "bool enable_gqa) -> Tensor")
_LIBRARY.impl("attention", _attention, "CompositeExplicitAutograd")
# A Meta kernel, which fake tensors run too (torch.library.register_fake looks up its caller's
# source, slowly where many modules are loaded: see embedding_backward.py)
_LIBRARY.impl("attention", _attention_meta, "Meta")

attention = torch.ops.torchweld.attention.default
