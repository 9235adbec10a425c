"""A compiled graph's outputs put back into the structure its Python code returned, per call.

`pytree.tree_unflatten` walks the spec in Python at every call: ~40 us under cProfile for a
training graph's flat tuple of outputs and saved tensors on the H100 host, three walks a
compiled transformer layer's forward and backward (issue 47's FSDP2 row, where the
GPU waits for the host). A flat tuple or list of tensors, what every aten graph returns,
is built directly; any other structure goes through pytree.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch.utils._pytree as pytree


def unflattener(spec: pytree.TreeSpec) -> Callable[[list], object]:
    """The function `leaves -> pytree.tree_unflatten(leaves, spec)`, fast for one tensor and for
    flat tuples and lists."""
    if spec.is_leaf():
        return operator.itemgetter(0)
    if spec.type in (tuple, list):  # not a namedtuple: its type is its own class
        children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
        if all(child.is_leaf() for child in children):
            return spec.type

    def unflatten(leaves: list) -> object:
        return pytree.tree_unflatten(leaves, spec)

    return unflatten
