"""Max pooling's backward from each window's argmax as a byte, not aten's int64 index.

`torchweld::max_pool2d_offsets(x, kernel_size, stride, padding, dilation, ceil_mode)`:
for each output element, the position of its window's maximum within the window
(kh * kernel_w + kw), int8, chosen as aten's kernels choose (the first maximum; the last
NaN; the first position inside the input where all are -inf).
`torchweld::max_pool2d_backward_from_offsets(grad_output, offsets, input_size, kernel_size,
stride, padding, dilation, ceil_mode)`: the input's gradient from those offsets.

The training partition saves the offsets in place of `max_pool2d_with_indices`' indices
(autograd/smaller_saves.py): resnet50's stem pool at batch 32 kept 49 MiB of int64
indices for the backward, 6 MiB as bytes (torch.compile keeps such offsets too). The
weld backend lowers both ops to kernels of their own (compiler/rules.py); these
implementations run where it calls them as aten ops (eagerly, or for a lowering it
refuses), built on aten's own pooling kernels.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_LIBRARY = torch.library.Library("torchweld", "FRAGMENT")
_LIBRARY.define("max_pool2d_offsets(Tensor self, int[2] kernel_size, int[2] stride, int[2] padding, "
                "int[2] dilation, bool ceil_mode) -> Tensor")
_LIBRARY.define("max_pool2d_backward_from_offsets(Tensor grad_output, Tensor offsets, SymInt[] input_size, "
                "int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode) -> Tensor")


def pool_window(kernel_size, stride=(), padding=0, dilation=1) -> tuple[list[int], ...]:
    """max_pool2d's (kernel, stride, padding, dilation) as pairs; an empty stride is the kernel's."""
    pair = lambda v: [v, v] if isinstance(v, int) else list(v) * (2 if len(v) == 1 else 1)  # noqa: E731
    kernel = pair(kernel_size)
    return kernel, pair(stride) if stride else kernel, pair(padding), pair(dilation)


def window_starts(out_shape, stride, padding, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output row's first input row and each output column's first input column
    (broadcastable over the output's last two dims)."""
    rows = torch.arange(out_shape[-2], device=device).unsqueeze(1) * stride[0] - padding[0]
    cols = torch.arange(out_shape[-1], device=device).unsqueeze(0) * stride[1] - padding[1]
    return rows, cols


def _offsets(x, kernel_size, stride, padding, dilation, ceil_mode):
    _, indices = aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, dilation, ceil_mode)
    width = x.shape[-1]
    rows, cols = window_starts(indices.shape, stride, padding, x.device)
    kh = torch.div(torch.div(indices, width, rounding_mode="floor") - rows, dilation[0], rounding_mode="floor")
    kw = torch.div(indices % width - cols, dilation[1], rounding_mode="floor")
    return (kh * kernel_size[1] + kw).to(torch.int8)


def _backward_from_offsets(grad_output, offsets, input_size, kernel_size, stride, padding, dilation, ceil_mode):
    offsets = offsets.long()
    rows, cols = window_starts(offsets.shape, stride, padding, offsets.device)
    kh, kw = torch.div(offsets, kernel_size[1], rounding_mode="floor"), offsets % kernel_size[1]
    indices = (rows + kh * dilation[0]) * input_size[-1] + cols + kw * dilation[1]
    like = grad_output.new_empty(input_size)  # aten reads its sizes alone
    return aten.max_pool2d_with_indices_backward.default(grad_output, like, kernel_size, stride, padding, dilation,
                                                         ceil_mode, indices)


def _offsets_meta(x, kernel_size, stride, padding, dilation, ceil_mode):
    values = aten.max_pool2d.default(x, kernel_size, stride, padding, dilation, ceil_mode)
    return torch.empty_like(values, dtype=torch.int8)


def _backward_meta(grad_output, offsets, input_size, kernel_size, stride, padding, dilation, ceil_mode):
    out = grad_output.new_empty(input_size)
    if grad_output.dim() == 4 and not grad_output.is_contiguous() \
            and grad_output.is_contiguous(memory_format=torch.channels_last):
        out = out.contiguous(memory_format=torch.channels_last)
    return out


_LIBRARY.impl("max_pool2d_offsets", _offsets, "CompositeExplicitAutograd")
_LIBRARY.impl("max_pool2d_backward_from_offsets", _backward_from_offsets, "CompositeExplicitAutograd")
# Meta kernels, which fake tensors run too (torch.library.register_fake looks up its caller's
# source, slowly where many modules are loaded: see embedding_backward.py)
_LIBRARY.impl("max_pool2d_offsets", _offsets_meta, "Meta")
_LIBRARY.impl("max_pool2d_backward_from_offsets", _backward_meta, "Meta")

max_pool2d_offsets = torch.ops.torchweld.max_pool2d_offsets.default
max_pool2d_backward_from_offsets = torch.ops.torchweld.max_pool2d_backward_from_offsets.default
