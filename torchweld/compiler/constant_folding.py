"""Compute once what depends only on a graph's constants, and again only when they change.

In an inference graph, parameters and buffers are constants (get_attr nodes).
Work that reads nothing else — batch norm folded into a convolution's weight
and bias, a weight converted to channels-last — would otherwise run on every
call: a kernel launch per weight, for results that never change. This pass
moves that work out of the graph: it runs it once here, and the graph reads the
results as new constants.

The model may still be updated in place (`load_state_dict`, an optimizer step,
`weight.mul_(2)`): `HoistedConstants.refresh()`, run before each call of the
compiled graph, compares each source tensor's version counter and data pointer
with what the results were computed from, and recomputes them in place (so a
CUDA graph that reads them by address sees the new values).

    aten_gm, hoisted = hoist_constants(aten_gm)
    ...
    hoisted.refresh()          # before each call; a few attribute reads when nothing changed
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from torchweld.compiler import aliasing, ir
from torchweld.compiler.op_effects import is_random, mutates

log = logging.getLogger("torchweld.weld")


@dataclasses.dataclass
class HoistedConstants:
    """The constant work taken out of a graph: `compute()` gives `targets` from `sources`."""

    sources: list[torch.Tensor]
    targets: list[torch.Tensor]
    compute: torch.fx.GraphModule
    stamps: list[tuple[int, int]]

    def refresh(self) -> None:
        stamps = [_stamp(t) for t in self.sources]
        if stamps == self.stamps:
            return
        log.debug("a parameter or buffer changed: recomputing %d folded constants", len(self.targets))
        with torch.no_grad():
            for target, value in zip(self.targets, self.compute(*self.sources)):
                target.copy_(value)
        self.stamps = [_stamp(t) for t in self.sources]


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    return t._version, t.data_ptr()


def _foldable(node: torch.fx.Node, constant: set) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if mutates(node) or is_random(node):
        return False
    inputs = node.all_input_nodes
    return bool(inputs) and all(n in constant for n in inputs) and isinstance(node.meta.get("val"), torch.Tensor)


def hoist_constants(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, HoistedConstants | None]:
    """`gm` with each constant-only computation replaced by a get_attr of its result
    (computed now), and what it takes to recompute them; (gm, None) when there is none."""
    graph = gm.graph
    constant: set[torch.fx.Node] = set()
    computes: set[torch.fx.Node] = set()  # constant nodes with a non-view op at or under them
    written = written_in_place(graph)  # a buffer the graph updates (batch norm's running statistics)
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor) and node not in written:
            constant.add(node)
        elif _foldable(node, constant):
            constant.add(node)
            if not ir.returns_alias(node.target) or any(n in computes for n in node.all_input_nodes):
                computes.add(node)
    boundary = [n for n in graph.nodes if n in computes and any(u not in constant for u in n.users)]
    if not boundary:
        return gm, None
    sources = [n for n in graph.nodes if n.op == "get_attr" and n in constant]
    sources = [s for s in sources if _stamped(getattr(gm, s.target))]
    compute = _subgraph(gm, [n for n in graph.nodes if n in constant], sources, boundary)
    if compute is None:
        return gm, None
    real_sources = [getattr(gm, s.target) for s in sources]
    with torch.no_grad():
        targets = [t.clone() if t._base is not None else t for t in compute(*real_sources)]
    for i, (node, value) in enumerate(zip(boundary, targets)):
        name = f"_folded_constant{i}"
        gm.register_buffer(name, value, persistent=False)
        with graph.inserting_before(node):
            attr = graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr)
    graph.eliminate_dead_code()
    gm.recompile()
    log.debug("hoisted %d constant computations out of the graph", len(boundary))
    return gm, HoistedConstants(real_sources, targets, compute, [_stamp(t) for t in real_sources])


def written_in_place(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose tensors an in-place op of `graph` writes, directly or through a view:
    their values change within a call, so nothing read from them is constant."""
    written = set()
    for node in graph.nodes:
        if mutates(node) and node.args:
            firsts = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            written |= {aliasing.base_of(a) for a in firsts if isinstance(a, torch.fx.Node)}
    return written


def _stamped(t: torch.Tensor) -> bool:
    try:
        _stamp(t)
        return True
    except RuntimeError:  # an inference tensor has no version counter
        return False


def _subgraph(gm, nodes, sources, outputs) -> torch.fx.GraphModule | None:
    """A GraphModule taking `sources` as inputs and returning `outputs`, made of `nodes`;
    None when a needed constant has no version counter to watch."""
    needed = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {s: sub.placeholder(s.name) for s in sources}
    for node in nodes:
        if node not in needed or node in env:
            continue
        if node.op == "get_attr":
            return None  # a constant we cannot watch feeds the folded work
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in outputs))
    return torch.fx.GraphModule(gm, sub)
