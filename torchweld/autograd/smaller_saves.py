"""Rewrites of a joint graph (before its partition) that let the backward read smaller
tensors: the same values computed, but what crosses from the forward to the backward
takes fewer bytes.

- `bernoulli(x, p)`, dropout's mask as `torch.nn.functional.dropout` draws it on the CPU
  (on CUDA it calls native_dropout, whose mask is bools already), becomes
  `rand_like(x) < p` converted to x's dtype: the same numbers drawn by the same kernels,
  and the partition may save the comparison's bools, a byte an element, rather than the
  float mask (BERT's training step on the CPU: 870 -> 760 MiB saved).
- `rand_like(x)` and `rand(size)` (dropout's draw, on either path) become
  `seeded_rand(seed, size)` of a seed drawn just before (runtime/seeded_rand.py): the same
  numbers for a given seed wherever they are computed, so the partition may save the seed,
  8 bytes, and draw the mask again in the backward, rather than save the mask, a byte an
  element. The draw still happens once, in the forward: its seed is the random op.
- `max_pool2d_with_indices` whose indices feed its backward, over a floating-point input
  with windows weld's kernels compute (tuning.max_window positions at most), not on the
  CPU (tuning.cpu_pool_offsets): the
  backward reads each window's argmax as an int8 offset within the window
  (runtime/pool_offsets.py) instead of the int64 index, and needs the input's sizes
  alone, not the input.
"""
from __future__ import annotations

import operator

import torch

from torchweld.runtime import pool_offsets, seeded_rand
from torchweld.tuning import tuning

aten, prims = torch.ops.aten, torch.ops.prims


def smaller_saves(graph: torch.fx.Graph) -> None:
    masks_of_comparisons(graph)
    draws_from_seeds(graph)
    max_pool_offsets(graph)


def masks_of_comparisons(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.bernoulli.p or node.kwargs.get("generator"):
            continue
        x, p = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        val = node.meta["val"]
        with graph.inserting_before(node):
            drawn = _call(graph, aten.rand_like.default, (x,), {"dtype": torch.float32})
            mask = _call(graph, aten.lt.Scalar, (drawn, p))
            values = _call(graph, prims.convert_element_type.default, (mask, val.dtype))
        node.replace_all_uses_with(values)
        graph.erase_node(node)


def draws_from_seeds(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.rand_like.default, aten.rand.default) \
                or node.kwargs.get("generator") is not None:
            continue
        val = node.meta["val"]
        if not seeded_rand.drawable(val) or not val.is_contiguous() or not all(isinstance(n, int) for n in val.shape):
            continue  # kept as drawn: weld's kernels draw 32-bit counters over dense row-major positions
        with graph.inserting_before(node), val.fake_mode:
            seed = _call(graph, aten.randint.low, (seeded_rand.SEED_LOW, seeded_rand.SEED_HIGH, []),
                         {"dtype": torch.int64, "device": val.device})
            values = _call(graph, seeded_rand.seeded_rand, (seed, list(val.shape), val.dtype))
        node.replace_all_uses_with(values)
        graph.erase_node(node)


def max_pool_offsets(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.max_pool2d_with_indices_backward.default:
            continue
        grad, x, kernel, stride, padding, dilation, ceil_mode, indices = node.args
        pool = indices.args[0] if indices.op == "call_function" and indices.target is operator.getitem else None
        if pool is None or pool.target is not aten.max_pool2d_with_indices.default or pool.args[0] is not x:
            continue
        window = pool_offsets.pool_window(kernel, stride, padding, dilation)
        if window[0][0] * window[0][1] > tuning.max_window or not x.meta["val"].is_floating_point():
            continue
        if x.meta["val"].device.type == "cpu" and not tuning.cpu_pool_offsets:
            continue  # aten's pool and backward: faster than weld's C++ kernel of offsets (tuning.py)
        with graph.inserting_after(pool):
            offsets = _call(graph, pool_offsets.max_pool2d_offsets, (x, *window, ceil_mode))
        with graph.inserting_before(node):
            sizes = list(x.meta["val"].shape)
            gradient = _call(graph, pool_offsets.max_pool2d_backward_from_offsets,
                             (grad, offsets, sizes, *window, ceil_mode))
        node.replace_all_uses_with(gradient)
        graph.erase_node(node)
        if not indices.users:
            graph.erase_node(indices)


def _call(graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """A new node of `target`, its value computed on its arguments' (fake) values."""
    node = graph.call_function(target, args, kwargs or {})
    values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    node.meta["val"] = target(*values, **(kwargs or {}))
    return node
