"""`torchweld::embedding_dense_backward`: an embedding's weight gradient on CUDA by atomic adds.

aten's CUDA kernel for a few thousand indices (`embedding_backward_feature_kernel`) took
about 50 us for GPT-2's 2048 tokens of 768 floats on an H100, whatever the table's size;
`index_add_` adds the same rows with atomics in a few microseconds. The order of the
atomic adds varies between runs, so a row that several tokens share sums in varying
order, as torch.compile's generated scatter does. aten's own kernel runs instead where
that matters or the adds would lose precision: deterministic algorithms on, a gradient
that is not float32 (atomic half adds round at every step), or `scale_grad_by_freq`.

An op of its own (not a Python function) so that the wrapper calls it through the
dispatcher with a schema, and profiler traces name it.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_LIBRARY = torch.library.Library("torchweld", "FRAGMENT")
_LIBRARY.define("embedding_dense_backward(Tensor grad_output, Tensor indices, SymInt num_weights, "
                "SymInt padding_idx, bool scale_grad_by_freq) -> Tensor")


def atomics_fit(grad_output: torch.Tensor, scale_grad_by_freq: bool) -> bool:
    """Whether atomic adds compute what aten's kernel would, up to the order of the sums."""
    return (not scale_grad_by_freq and grad_output.dtype == torch.float32
            and not torch.are_deterministic_algorithms_enabled())


def _by_index_add(grad_output: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                  scale_grad_by_freq: bool) -> torch.Tensor:
    if not atomics_fit(grad_output, scale_grad_by_freq):
        return aten.embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    width = grad_output.shape[-1]
    out = grad_output.new_zeros((num_weights, width))
    out.index_add_(0, indices.reshape(-1), grad_output.reshape(-1, width))
    if padding_idx >= 0:  # the padding row gets no gradient (aten passes -1 for none)
        out[padding_idx].zero_()
    return out


def _empty_like_result(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad_output.new_empty((num_weights, grad_output.shape[-1]))


_LIBRARY.impl("embedding_dense_backward", _by_index_add, "CompositeExplicitAutograd")
# A Meta kernel, which fake tensors run too. torch.library.register_fake looks up its caller's
# source (inspect.getmodule, a realpath of every loaded module's file): 0.28 s of BERT's
# backward lowering on the H100 host, with transformers loaded.
_LIBRARY.impl("embedding_dense_backward", _empty_like_result, "Meta")

embedding_dense_backward = torch.ops.torchweld.embedding_dense_backward.default
