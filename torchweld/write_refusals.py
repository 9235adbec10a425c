"""The checks aten makes before an in-place kernel writes a tensor, which fake tensors do not
make: the written tensor may not have elements that share memory (an expanded view), nor
share memory in part with another argument (`x.add_(x[0])`). Eager raises there. Capture
breaks the graph at such a write (the write then runs as eager's, raising at the user's
line, after the side effects before it); weld's lowering refuses one a graph still holds.
"""
from __future__ import annotations

import math

import torch

INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a single "
                    "memory location. Please clone() the tensor before performing the operation.")
PARTIAL_OVERLAP = ("unsupported operation: some elements of the input tensor and the written-to tensor refer "
                   "to a single memory location. Please clone() the tensor before performing the operation.")


def overlap_refusal(written: torch.Tensor, others: list) -> str | None:
    """Eager's error for writing `written` in place with `others` among the operands, or None.
    With symbolic sizes each comparison the answer rests on is decided at the example values
    and recorded as a guard by their shape environment (`x[:k] += x[n - k:]` overlaps only
    where 2k > n): a call where the answer differs is another version. A tensor with a size
    that has no example value (data-dependent) is not checked."""
    a = _layout(written)
    if a is None:
        return None
    if internal_overlap(a[0], a[1]):
        return INTERNAL_OVERLAP
    for other in others:
        b = _layout(other) if isinstance(other, torch.Tensor) and other is not written else None
        if b is not None and partial_overlap(a, b):
            return PARTIAL_OVERLAP
    return None


def _layout(t: torch.Tensor) -> tuple | None:
    """(shape, strides, storage offset, element size, storage), symbolic sizes as they are
    (comparing them guards); None for a tensor without a strided storage or a size with no
    example value."""
    if t.layout != torch.strided:
        return None
    numbers = [*t.shape, *t.stride(), t.storage_offset()]
    if any(isinstance(n, torch.SymInt) and n.node.hint is None for n in numbers):
        return None
    try:
        storage = t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None
    d = t.dim()
    return tuple(numbers[:d]), tuple(numbers[d:2 * d]), numbers[-1], t.element_size(), storage


def internal_overlap(shape: tuple, stride: tuple) -> bool:
    """aten's has_internal_overlap == Yes: a dim of size > 1 with stride 0."""
    return any(st == 0 and size > 1 for size, st in zip(shape, stride))


def partial_overlap(a: tuple, b: tuple) -> bool:
    """aten's get_overlap_status(a, b) == Partial for two `_layout`s: both dense, in one
    storage, their spans meet and are not the same span with the same strides."""
    (a_shape, a_stride, a_offset, a_size, a_storage), (b_shape, b_stride, b_offset, b_size, b_storage) = a, b
    if a_storage != b_storage or 0 in a_shape or 0 in b_shape:
        return False
    if not (non_overlapping_and_dense(a_shape, a_stride) and non_overlapping_and_dense(b_shape, b_stride)):
        return False
    a_begin, b_begin = a_offset * a_size, b_offset * b_size
    a_end, b_end = a_begin + math.prod(a_shape) * a_size, b_begin + math.prod(b_shape) * b_size
    if (a_begin, a_end) == (b_begin, b_end):
        return a_stride != b_stride
    return a_begin < b_end and b_begin < a_end


def non_overlapping_and_dense(shape: tuple, stride: tuple) -> bool:
    """Whether the strides lay the elements out densely, each once, in some order of the dims
    (torch._prims_common.is_non_overlapping_and_dense, which took 88 us on a channels-last
    shape against 11 us on a contiguous one: 0.2 s of resnet50's lowering on the H100 host)."""
    if 0 in shape:
        return True
    expected = 1
    for st, length in sorted((st, length) for length, st in zip(shape, stride) if length != 1):
        if st != expected:
            return False
        expected *= length
    return True
