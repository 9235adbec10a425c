"""Split a joint graph into a forward graph (outputs, new buffer values, and the
tensors the backward needs) and a backward graph (gradients from those saved
tensors and the tangents).

Two strategies choose what crosses over:
  save_all  — the backward reads forward values; save each one it reads.
  min_cut   — cheap pointwise/view ops may be recomputed in the backward from
              other saved values; choose the set of saved tensors with the
              fewest bytes (a minimum cut, in the spirit of "recompute over save"
              partitioners). Matmuls, convolutions, reductions and random ops are
              never recomputed: random ones always run once, in the forward (dropout's
              mask may be drawn again, from the seed the forward drew it with). Nor is
              a value that a matmul (or another op no kernel fuses) of the backward
              reads: it would be written to memory in the backward all the same, by
              a kernel of its own.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import operator

import sympy
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import free_symbols

from torchweld.autograd.joint import JointGraph
from torchweld.autograd.mincut import INF, FlowGraph
from torchweld.compiler import symbols
from torchweld.compiler.graph_modules import graph_module
from torchweld.compiler.op_effects import is_random, is_view
from torchweld.runtime import seeded_rand
from torchweld.tuning import tuning

aten, prims = torch.ops.aten, torch.ops.prims

# Cheap to recompute besides pointwise-tagged ops and views.
RECOMPUTABLE = {
    aten.full.default, aten.zeros.default, aten.ones.default, aten.scalar_tensor.default, aten.arange.start_step,
    aten.arange.start, aten.arange.default, aten.empty.memory_format, aten.full_like.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten._to_copy.default,
    aten.clone.default, aten.copy.default, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther,
    aten.where.Scalar, aten.expand.default, aten.broadcast_to.default, aten.cat.default,
    prims.broadcast_in_dim.default, prims.convert_element_type.default, prims.iota.default, prims.where.default,
    prims.add.default, prims.sub.default, prims.mul.default, prims.div.default, operator.getitem,
    seeded_rand.seeded_rand,  # dropout's numbers from a saved seed, the same each time
}


@dataclasses.dataclass
class Partition:
    """Forward and backward graphs, and what the forward hands the backward.

    forward: (*primals) -> (*outputs, *new_values, *saved intermediates)
    backward: (*saved, *tangents) -> (*grads)
    saved: for each saved tensor, the backward's first inputs, ("primal", i) or ("forward", j)
    (the j-th saved intermediate output of the forward).
    numbers: over symbolic sizes, the backward's inputs after the saved tensors and before the
    tangents: (i, d), the size d of primal i, or (i, None), primal i itself (an int argument)."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    saved: list[tuple[str, int]]
    saved_nodes: list[str]
    saved_bytes: int  # of saved intermediates (primals are alive anyway)
    numbers: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)


class UnboundSymbol(Exception):
    """The backward computes with a symbol that no input's size, nor an int input, holds."""


def is_recomputable(node: torch.fx.Node) -> bool:
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or is_random(node):
        return False
    t = node.target
    if t is seeded_rand.seeded_rand and not tuning.redraw_dropout:
        return False
    if t in RECOMPUTABLE or is_view(node):
        return True
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags


def read_whole_in_backward(node: torch.fx.Node, tangent_side: set) -> bool:
    """Whether an op of the backward that fuses with nothing (a matmul, attention, a
    convolution) reads `node`, directly or through views. Recomputed, `node` would then
    be a kernel of its own that writes it to memory: saving it moves fewer bytes."""
    if is_view(node):
        return False
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if is_view(user):
            stack.extend(user.users)
        elif user in tangent_side and user.op == "call_function" and not is_recomputable(user):
            return True
    return False


def nbytes(node: torch.fx.Node) -> float:
    """Bytes of the tensor `node` makes; infinite for what cannot be saved (tuples, non-tensors).
    Symbolic sizes count at the compiled call's values: what is saved is right at every size."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return INF
    return math.prod(map(symbols.hint, val.shape)) * val.element_size()


def _ancestors(roots, stop=lambda n: False) -> set:
    seen, stack = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if not stop(n):
            stack.extend(n.all_input_nodes)
    return seen


def _descendants(roots) -> set:
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen


def partition(joint: JointGraph, strategy: str = "min_cut") -> Partition:
    primals, tangents, outputs, new_values, grads = joint.node_groups()
    tangent_side = _descendants(tangents)
    backward_nodes = _ancestors(grads) & tangent_side
    forward_outputs = [*outputs, *new_values]
    if any(isinstance(o, torch.fx.Node) and o in tangent_side for o in forward_outputs):
        raise AssertionError("a forward output depends on a tangent")
    # Values computed without tangents that the backward reads, directly or not.
    frontier = {a for n in backward_nodes for a in n.all_input_nodes if a not in tangent_side}
    if strategy == "save_all":
        saved = frontier
    elif strategy == "min_cut":
        saved = _min_cut_saved(joint, frontier, tangent_side, forward_outputs)
    else:
        raise ValueError(f"unknown partition strategy {strategy!r}; choose 'min_cut' or 'save_all'")
    order = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    saved = sorted(saved, key=order.__getitem__)
    primal_index = {p: i for i, p in enumerate(primals)}
    saved_intermediates = [n for n in saved if n not in primal_index]
    forward = extract(joint.gm, primals, [*forward_outputs, *saved_intermediates])
    compute_early(forward.graph, first_saved=len(forward_outputs))
    backward = extract(joint.gm, [*saved, *tangents], grads)
    recompute_late(backward.graph, first_tangent=len(saved))
    numbers = _numbers_for_backward(backward, primals, first_tangent=len(saved))
    spec, j = [], 0
    for n in saved:
        if n in primal_index:
            spec.append(("primal", primal_index[n]))
        else:
            spec.append(("forward", j))
            j += 1
    return Partition(forward, backward, spec, [n.name for n in saved],
                     int(sum(nbytes(n) for n in saved_intermediates)), numbers)


def _numbers_for_backward(backward: torch.fx.GraphModule, primals: list[torch.fx.Node],
                          first_tangent: int) -> list[tuple[int, int | None]]:
    """Over symbolic sizes: the symbols the backward computes with that none of its inputs' sizes
    is (the compiled wrapper binds a symbol from an input's size, `s27 = arg3.size(0)`, or from an
    int input), each given to it as an int input of its own before the tangents, read from the
    primal whose size (or value) it is. A saved `h.view(b * t, d)` holds b * t, not b; an int
    argument's symbol is in no tensor's sizes. [] over static sizes."""
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    bound: set = set()
    for p in placeholders:
        val = p.meta.get("val")
        for n in (val.shape if isinstance(val, torch.Tensor) else [val]):
            if isinstance(n, torch.SymInt) and isinstance(n.node.expr, sympy.Symbol):
                bound.add(n.node.expr)
    needed: set = set()
    for node in backward.graph.nodes:
        for value in pytree.tree_leaves((node.meta.get("val"), node.args, node.kwargs)):
            needed |= _symbols_of(value)
    missing = sorted(needed - bound, key=str)
    if not missing:
        return []
    sources: dict = {}  # symbol -> ((primal, dim), its SymInt)
    for i, p in enumerate(primals):
        val = p.meta.get("val")
        sizes = enumerate(val.shape) if isinstance(val, torch.Tensor) else [(None, val)]
        for d, n in sizes:
            if isinstance(n, torch.SymInt) and isinstance(n.node.expr, sympy.Symbol):
                sources.setdefault(n.node.expr, ((i, d), n))
    unknown = [s for s in missing if s not in sources]
    if unknown:
        raise UnboundSymbol(f"the backward computes with {', '.join(map(str, unknown))}, which no input holds")
    anchor = placeholders[first_tangent] if first_tangent < len(placeholders) else \
        next(n for n in backward.graph.nodes if n.op != "placeholder")
    for symbol in missing:
        with backward.graph.inserting_before(anchor):
            node = backward.graph.placeholder(f"size_{symbol}")
        node.meta["val"] = sources[symbol][1]
    backward.recompile()
    return [sources[s][0] for s in missing]


def _symbols_of(value) -> set:
    """The free symbols of a node's value or argument: a symbolic number's, a tensor's sizes',
    strides' and offset's."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        return set(free_symbols(value))
    return set()


def _min_cut_saved(joint: JointGraph, frontier: set, tangent_side: set, forward_outputs: list) -> set:
    """The tensors to save so that saved bytes are fewest, recomputing only cheap ops.

    The module's parameters and buffers cost no bytes to save: they stay in memory anyway.
    Among cuts of equal bytes the one saving later values wins: each capacity is its bytes
    times (node count squared + 1), more than all distances together, plus the node's
    distance from the graph's end. GPT-2's residual stream, h = h + dropout(branch) in each
    block, saves as many bytes whether it keeps each h or each branch output; keeping the
    branch outputs would recompute all of the stream at the start of the backward."""
    required_forward = _ancestors(forward_outputs)
    candidates = _ancestors(frontier) - tangent_side
    nodes = list(joint.gm.graph.nodes)
    distance_to_end = {n: len(nodes) - i for i, n in enumerate(nodes)}
    primals = joint.node_groups()[0]
    resident = {primals[i] for i in joint.resident_primals}
    too_far = far_from_saved_values(nodes, candidates & required_forward)
    flow = FlowGraph()
    for n in candidates:
        if n.op == "placeholder" or is_random(n) or (n in required_forward and not is_recomputable(n)) \
                or (n.op == "call_function" and read_whole_in_backward(n, tangent_side)) or n in too_far:
            flow.add_edge("source", (n, "in"), INF)
        elif not is_recomputable(n):
            # Not needed by the forward: the backward may compute it once itself; never twice.
            pass
        cost = distance_to_end[n] if n.op == "get_attr" or n in resident else \
            nbytes(n) * (len(nodes) ** 2 + 1) + distance_to_end[n]
        flow.add_edge((n, "in"), (n, "out"), cost)
        for user in n.users:
            if user in tangent_side:
                flow.add_edge((n, "out"), "sink", INF)
            elif user in candidates:
                flow.add_edge((n, "out"), (user, "in"), INF)
    _, source_side = flow.min_cut("source", "sink")
    return {n for n in candidates if (n, "in") in source_side and (n, "out") not in source_side}


def far_from_saved_values(nodes: list, forward: set) -> set:
    """Values of the forward (`forward`: those it computes for its outputs) that every chain of
    cheap ops from an earlier value runs through (a bottleneck), more than
    tuning.max_recompute_span forward nodes after where the chain started: they are
    computed in the forward (and saved where the backward reads them), so that no
    recomputation in the backward reaches back further, as torch.compile's partitioner bans
    long fusible chains. The residual stream of a transformer, h = h + branch in each block, is
    such a chain over the whole network: under autocast each bfloat16 branch output has half
    the bytes of the float32 h, so the fewest bytes saved were the branch outputs, and the
    backward recomputed all of the stream in its first kernel (a 1.1B Llama: 44 float32 tensors
    of 32 MB written there, 4.9 ms of a 97 ms step, and more memory at the backward's start,
    not less). Only the bottlenecks (the stream's h), not the values beside the chain (a norm's
    intermediates), are kept from being recomputed: banning every far value saved 40% more
    bytes in GPT-2's step."""
    position = {n: i for i, n in enumerate(nodes)}
    visited: set = set()
    too_far = set()
    for first in nodes:
        if first not in forward or first in visited:
            continue
        frontier = [(position[first], first)]  # a heap: the chain's values in forward order
        while frontier:
            _, node = heapq.heappop(frontier)
            if node in visited:
                continue
            visited.add(node)
            if not frontier and position[node] - position[first] > tuning.max_recompute_span:
                too_far.add(node)  # every chain from `first` runs through it
                break
            for user in node.users:
                if user in forward and user not in too_far and is_recomputable(user):
                    heapq.heappush(frontier, (position[user], user))
    return too_far


def compute_early(graph: torch.fx.Graph, first_saved: int) -> None:
    """Move each op of the forward that only saved values need (ops of the backward that the
    cut moved over, such as GELU's derivative, saved instead of its input) to just after the
    last of its inputs. Copied in joint order they would all run at the forward's end:
    each input lived until then, and kernels fused across the network's layers there (BERT's
    twelve GELU derivatives were one kernel, its slowest compile) rather than beside the
    ops that read the same inputs."""
    nodes = list(graph.nodes)
    output = nodes[-1]
    needed = _ancestors([o for o in output.args[0][:first_saved] if isinstance(o, torch.fx.Node)])
    movable = [n for n in nodes if n not in needed and n.op == "call_function" and n.all_input_nodes]
    waiting = {n: len(n.all_input_nodes) for n in movable}  # each input once
    order: list[torch.fx.Node] = []
    ready: collections.deque[torch.fx.Node] = collections.deque()

    def emit(node: torch.fx.Node) -> None:
        order.append(node)
        for user in node.users:  # in the order the graph has them
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)

    placeholders = [n for n in nodes if n.op == "placeholder"]
    for node in placeholders + [n for n in nodes if n.op != "placeholder" and n not in waiting]:
        emit(node)
        if node.op != "placeholder" or node is placeholders[-1]:
            while ready:  # each moved op as soon as its inputs are, those it releases next
                emit(ready.popleft())
    previous = order[0]
    for node in order[1:]:
        if previous.next is not node:
            previous.append(node)
        previous = node
    graph.lint()


def recompute_late(graph: torch.fx.Graph, first_tangent: int) -> None:
    """Move each op of the backward that reads no tangent (forward ops recomputed from saved
    values) to just before the first op that needs it. Copied in joint order they would all
    run first, and every recomputed activation would be alive at once."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    on_tangents = _descendants(placeholders[first_tangent:])
    order, placed = [], set(placeholders)
    for node in list(graph.nodes):
        if node not in on_tangents and node.op != "output":
            continue
        stack = [node]  # place `node` after its not yet placed inputs, depth first
        while stack:
            top = stack[-1]
            waiting = [a for a in top.all_input_nodes if a not in placed]
            if waiting:
                stack.extend(waiting)
                continue
            stack.pop()
            if top not in placed:
                placed.add(top)
                order.append(top)
    anchor = placeholders[-1] if placeholders else None
    for node in order:
        if anchor is None:
            next(iter(graph.nodes)).prepend(node)
        else:
            anchor.append(node)
        anchor = node
    graph.lint()


def extract(gm: torch.fx.GraphModule, inputs: list[torch.fx.Node], outputs: list) -> torch.fx.GraphModule:
    """A new graph computing `outputs` from `inputs`, copying the nodes of `gm` between them."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    needed = _ancestors(outputs, stop=lambda n: n in env)
    for n in gm.graph.nodes:
        if n not in needed or n in env:
            continue
        if n.op == "placeholder":
            raise AssertionError(f"extracting a graph reached {n.name}, which is not one of its inputs")
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output([env[o] if isinstance(o, torch.fx.Node) else o for o in outputs])
    graph.lint()
    return graph_module(gm, graph)
