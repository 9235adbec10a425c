"""Attention over grouped key/value heads without copying them per query head.

Grouped-query attention (Llama, Mistral; gpt-fast's decoder) keeps `kv` key/value heads for
`h = kv * r` query heads and repeats each r times before attention:

    k = k.repeat_interleave(r, dim=1)                       # gpt-fast
    k = k[:, :, None].expand(b, kv, r, s, d).reshape(b, h, s, d)   # transformers' repeat_kv
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

The repeat writes r copies of the whole key/value cache at every decoding step and attention
reads them back: at batch 8 on the H100 the copy alone took as long as attention itself. For
one query position (decoding: q is [b, h, 1, d]), the r query heads of a group are r rows of
one attention over that group's key/value head, so

    out = sdpa(q.reshape(b, kv, r, d), k, v, attn_mask=mask row per query head as [b, kv, r, s])
              .reshape(b, h, 1, d)

computes the same numbers, each row by the same kernel, and reads each cache once. The mask
row, broadcast over heads, is a view (no copy). Only this form is rewritten: q of length 1,
no dropout, not causal, no enable_gqa; k and v repeated by the same factor from heads of
equal shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node


SDPAS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
REPEAT_INTERLEAVES = ("repeat_interleave", torch.repeat_interleave, torch.Tensor.repeat_interleave)
RESHAPES = ("reshape", "view", torch.reshape)
EXPANDS = ("expand",)


def _decode_attention():
    """runtime/decode_attention.py, imported where a graph may use it: defining its operator
    reads its source (torch.library), 50 ms of every process's first compile."""
    from torchweld.runtime import decode_attention

    return decode_attention


def group_query_heads(gm: GraphModule, split_kernel: bool = False) -> GraphModule:
    """`gm` with each attention over repeated key/value heads of one query position made over
    the unrepeated heads (in place; returned for chaining). With `split_kernel` (inference),
    attention on CUDA in half precision runs as runtime/decode_attention.py's kernel, split
    along the cache, instead of aten's (which gives a whole cache to one thread block)."""
    count = 0
    for node in list(gm.graph.nodes):
        match = _match(node)
        if match is None:
            continue
        q, (k, k_squeeze), (v, v_squeeze), mask, scale, repeats = match
        b, h, _, d = _example(q).shape
        graph = gm.graph
        repeated = [node.kwargs.get(name, node.args[i] if len(node.args) > i else None)
                    for i, name in ((1, "key"), (2, "value"))]
        with graph.inserting_before(node):
            k = _call(graph, "squeeze", k, 2) if k_squeeze else k
            v = _call(graph, "squeeze", v, 2) if v_squeeze else v
            kv, s = h // repeats, _example(k).shape[-2]
            grouped_q = _call(graph, "reshape", q, (b, kv, repeats, d))
            kwargs = {"dropout_p": 0.0}
            if mask is not None:
                rows = _call(graph, "expand", mask, (b, h, 1, s))
                kwargs["attn_mask"] = _call(graph, "reshape", rows, (b, kv, repeats, s))
            if scale is not None:
                kwargs["scale"] = scale
            examples = {key: _example(a) if isinstance(a, Node) else a for key, a in kwargs.items()}
            if split_kernel and not isinstance(scale, Node) and _decode_attention().supported(_example(grouped_q),
                                                                                             _example(k)):
                args = (grouped_q, k, v, kwargs.get("attn_mask"), float(scale if scale is not None else d ** -0.5))
                out = graph.call_function(torch.ops.torchweld.decode_attention.default, args)
            else:
                out = graph.call_function(F.scaled_dot_product_attention, (grouped_q, k, v), kwargs)
            out.meta["example_value"] = F.scaled_dot_product_attention(
                _example(grouped_q), _example(k), _example(v), **examples)
            result = _call(graph, "reshape", out, (b, h, 1, d))
        result.meta.update({k_: v_ for k_, v_ in node.meta.items() if k_ != "example_value"})
        result.meta["example_value"] = _call_example("reshape", _example(out), (b, h, 1, d))
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        for dead in repeated:  # the repeats (and repeat_kv's expands), read by nothing now
            while isinstance(dead, Node) and not dead.users and dead.op in ("call_method", "call_function"):
                before = dead.args[0]
                graph.erase_node(dead)
                dead = before if isinstance(before, Node) and before.target in EXPANDS else None
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return gm


def _match(node: Node):
    """(q, ungrouped k, ungrouped v, mask or None, scale or None, repeats) of an attention
    `group_query_heads` rewrites, or None."""
    if node.op != "call_function" or node.target not in SDPAS:
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    bound = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        bound[key] = value
    if set(bound) - {*names, "scale", "enable_gqa"} or bound.get("dropout_p", 0.0) != 0.0 \
            or bound.get("is_causal", False) is not False or bound.get("enable_gqa", False) is not False:
        return None
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
    examples = [_example(a) for a in (q, k, v)] + ([_example(mask)] if mask is not None else [])
    if any(e is None or e.dim() != 4 or any(isinstance(n, torch.SymInt) for n in e.shape) for e in examples[:3]) \
            or mask is not None and (examples[3] is None or examples[3].dim() > 4):
        return None  # symbolic sizes would go into the new nodes' arguments as numbers
    b, h, length, d = examples[0].shape
    s = examples[1].shape[-2]
    if length != 1 or tuple(examples[1].shape) != (b, h, s, d) or tuple(examples[2].shape) != (b, h, s, d):
        return None  # one query position; v's head size as q's (the result is reshaped by it)
    k0, v0 = _unrepeated(k, h), _unrepeated(v, h)
    if k0 is None or v0 is None or k0[1] != v0[1] or k0[1] < 2:
        return None
    (k0, repeats, k_squeeze), (v0, _, v_squeeze) = k0, v0
    if _heads_shape(k0, k_squeeze) != (b, h // repeats, s, d) or _heads_shape(v0, v_squeeze) != (b, h // repeats, s, d):
        return None
    if mask is not None and not _broadcasts(tuple(examples[3].shape), (b, h, 1, s)):
        return None
    return q, (k0, k_squeeze), (v0, v_squeeze), mask, bound.get("scale"), repeats


def _heads_shape(node: Node, squeeze: bool) -> tuple:
    """The shape of the unrepeated heads: `node`'s, without repeat_kv's unsqueezed dim 2."""
    shape = tuple(_example(node).shape)
    return shape[:2] + shape[3:] if squeeze else shape


def _unrepeated(node: object, heads: int):
    """(the tensor of kv heads that `node` repeats r times along dim 1, r, whether that tensor
    has repeat_kv's unsqueezed dim 2 still), or None."""
    if not isinstance(node, Node) or len(node.users) != 1:
        return None
    target = node.target
    if target in REPEAT_INTERLEAVES and node.op in ("call_method", "call_function"):
        source = node.args[0] if node.args else None
        repeats = node.kwargs.get("repeats", node.args[1] if len(node.args) > 1 else None)
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        example = _example(source)
        if not isinstance(repeats, int) or example is None or example.dim() != 4 or dim not in (1, -3) \
                or "output_size" in node.kwargs or example.shape[1] * repeats != heads:
            return None
        return source, repeats, False
    if target in RESHAPES and node.op in ("call_method", "call_function"):  # repeat_kv: expand, reshape
        expanded = node.args[0] if node.args else None
        if not isinstance(expanded, Node) or expanded.target not in EXPANDS or len(expanded.users) != 1:
            return None
        unsqueezed = expanded.args[0]
        e5, u5 = _example(expanded), _example(unsqueezed)
        if e5 is None or u5 is None or e5.dim() != 5 or u5.dim() != 5 or u5.shape[2] != 1 \
                or u5.shape[1] * e5.shape[2] != heads or tuple(e5.shape[3:]) != tuple(u5.shape[3:]):
            return None
        return unsqueezed, e5.shape[2], True
    return None


def _call(graph, method: str, node: Node, *args) -> Node:
    new = graph.call_method(method, (node, *args))
    new.meta["example_value"] = _call_example(method, _example(node), *args)
    return new


def _call_example(method: str, example, *args):
    return getattr(example, method)(*args)


def _broadcasts(shape: tuple, to: tuple) -> bool:
    shape = (1,) * (len(to) - len(shape)) + shape
    return all(a in (1, b) for a, b in zip(shape, to))


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None
