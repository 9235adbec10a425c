"""Group lowered buffers into fused kernels and order kernels, extern calls and frees.

Greedy, in graph order: a Pointwise or Reduction joins the kernel of one of its
producers when their iteration spaces line up:

    kernel iteration = outer dims (parallel) x reduced dims (the r-loop)
    member kinds     = Reduction over (full, reduced) | Pointwise over full
                       | Pointwise over outer (after the reductions)

Inside a kernel no member is ever loaded from memory: a reader recomputes a
pointwise member at the index it needs (CSE'd by the renderer), and sees a
reduction member only at its own outer index. A member is stored only if
something outside its kernel reads it. The result is a `Schedule` of small
frozen steps whose expressions are in the kernel's loop variables.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Iterable

import torch
import torch.utils._pytree as pytree

from torchweld.compiler import ir
from torchweld.compiler.ir import Expr, Op
from torchweld.compiler.lowering import LoweredGraph, BufferView
from torchweld.compiler.symbols import is_symbol_size, same_sizes, size_key
from torchweld.tuning import tuning


# =============================================================================
# What the schedule is made of
# =============================================================================


@dataclasses.dataclass(frozen=True)
class Store:
    buffer: str
    index: Expr  # flat element offset, in the kernel's loop variables
    value: Expr


@dataclasses.dataclass(frozen=True)
class Accumulate:
    name: str  # the Reduction buffer; later Exprs read it as Op.REDUCED
    reduce_op: Op
    dtype: torch.dtype
    value: Expr


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pass over the reduced dims: accumulate some reductions, store some values."""

    reductions: tuple[Accumulate, ...]
    stores: tuple[Store, ...]


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    device: torch.device
    outer: tuple[int, ...]  # sizes of loop variables x0, x1, ...
    reduced: tuple[int, ...]  # sizes of loop variables r0, r1, ... (empty: pointwise)
    stages: tuple[Stage, ...]
    outer_stores: tuple[Store, ...]  # after all stages, at the outer index
    reads: tuple[str, ...]  # stored buffers it loads
    writes: tuple[str, ...]  # buffers it stores
    members: tuple[str, ...]  # every buffer it computes, stored or not

    @property
    def is_reduction(self) -> bool:
        return bool(self.reduced)

    @property
    def args(self) -> list[str]:
        """The kernel's pointer parameters, in order: what it reads, then what it only writes."""
        return list(self.reads) + [w for w in self.writes if w not in self.reads]

    @property
    def over_symbols(self) -> bool:
        """Whether its sizes, or integers of its index arithmetic, are symbols (a graph compiled
        once for every size: backends/weld_symbolic.py). Kept in the kernel's own __dict__."""
        found = self.__dict__.get("_over_symbols")
        if found is None:
            stores = [*(st for stage in self.stages for st in stage.stores), *self.outer_stores]
            exprs = [*(a.value for stage in self.stages for a in stage.reductions),
                     *(e for st in stores for e in (st.index, st.value))]
            found = any(map(is_symbol_size, (*self.outer, *self.reduced))) or any(
                ir.is_symbolic_const(n) for e in exprs for n in ir.walk(e))
            self.__dict__["_over_symbols"] = found
        return found


@dataclasses.dataclass(frozen=True)
class ExternCall:
    name: str  # the ir.Extern buffer


@dataclasses.dataclass(frozen=True)
class Free:
    names: tuple[str, ...]


Step = Kernel | ExternCall | Free


@dataclasses.dataclass(frozen=True)
class Schedule:
    steps: tuple[Step, ...]
    layouts: dict  # name -> (dtype, Layout, device) of every stored buffer
    allocated: tuple[str, ...]  # buffers the wrapper allocates (kernel outputs)
    graph: LoweredGraph
    in_place: dict = dataclasses.field(default_factory=dict)  # buffer -> the input it is stored into
    stored_over: dict = dataclasses.field(default_factory=dict)  # buffer -> the dying buffer whose memory it takes
    frees_inputs: bool = False  # whether inputs are freed after their last reader too (schedule's frees_inputs)

    def kernels(self) -> list[Kernel]:
        return [s for s in self.steps if isinstance(s, Kernel)]


def structure(kernel: Kernel, numbers: bool = True) -> tuple:
    """What `kernel` computes, with its buffers named by their place in `args` and its
    reductions by their place in its stages: kernels with equal structures (one block of a
    network repeated, its buffers named apart) differ only in the names of their arguments,
    so a renderer's text for one is the other's. Each distinct subexpression is numbered in
    the order a walk first meets it, and the structure lists them (op, dtype, arg, argument
    numbers): its size is the expressions', however much they share.

    With `numbers` false, the integer and float constants and the loop sizes are left out (a
    size of 1 is kept: its loop variable is no variable): kernels with equal such structures
    differ only in their numbers, the members of one family (codegen/size_args.py)."""
    position = {name: i for i, name in enumerate(kernel.args)}
    accumulator = {acc.name: (s, r) for s, stage in enumerate(kernel.stages) for r, acc in enumerate(stage.reductions)}
    nodes: dict[tuple, int] = {}  # (op, dtype, arg, argument numbers) -> number
    numbered: dict[int, tuple[Expr, int]] = {}  # id(expression) -> (expression, number)

    def number(e: Expr) -> int:
        got = numbered.get(id(e))
        if got is not None:
            return got[1]
        arg = e.arg
        if e.op is Op.CONST and not numbers and type(arg) in (int, float):
            arg = type(arg)
        elif e.op is Op.LOAD or e.op is Op.MASKED_LOAD:
            arg = position[arg]
        elif e.op is Op.REDUCED:
            arg = accumulator[arg]
        n = nodes.setdefault((e.op, e.dtype, arg, tuple([number(a) for a in e.args])), len(nodes))
        numbered[id(e)] = (e, n)
        return n

    def store(st: Store) -> tuple:
        return position[st.buffer], number(st.index), number(st.value)

    stages = tuple((tuple((a.reduce_op, a.dtype, number(a.value)) for a in stage.reductions),
                    tuple(store(st) for st in stage.stores)) for stage in kernel.stages)
    outer_stores = tuple(store(st) for st in kernel.outer_stores)
    outer, reduced = tuple(map(size_key, kernel.outer)), tuple(map(size_key, kernel.reduced))
    if not numbers:
        outer, reduced = tuple(s == 1 for s in outer), tuple(s == 1 for s in reduced)
    return kernel.device.type, outer, reduced, len(kernel.args), stages, outer_stores, tuple(nodes)


def map_exprs(kernel: Kernel, value, index=lambda e: e) -> Kernel:
    """`kernel` with `value(e)` for every accumulated or stored value and `index(e)` for every store offset."""
    def store(st: Store) -> Store:
        return Store(st.buffer, index(st.index), value(st.value))

    stages = tuple(Stage(tuple(dataclasses.replace(a, value=value(a.value)) for a in stage.reductions),
                         tuple(store(st) for st in stage.stores)) for stage in kernel.stages)
    return dataclasses.replace(kernel, stages=stages, outer_stores=tuple(store(st) for st in kernel.outer_stores))


# =============================================================================
# Grouping
# =============================================================================


@dataclasses.dataclass
class _Group:
    position: int
    full: tuple[int, ...]
    reduced: tuple[int, ...]  # dims of `full` that are reduced (empty: pointwise)
    device: torch.device
    members: list = dataclasses.field(default_factory=list)
    reads: set = dataclasses.field(default_factory=set)  # what its members read, members included
    reshaped: bool = False  # a member is over another shape of as many elements (see kind_of)

    def has_room(self, buf) -> bool:
        if math.prod(self.full) == 1:
            return len(self.members) < tuning.single_element_members
        if len(self.members) >= tuning.max_kernel_members:
            return False
        return len((self.reads | buf.reads()) - set(self.members) - {buf.name}) <= tuning.max_kernel_reads

    @property
    def outer_shape(self) -> tuple[int, ...]:
        return tuple(s for i, s in enumerate(self.full) if i not in self.reduced)

    def kind_of(self, buf) -> str | None:
        """How `buf` would sit in this kernel: 'reduction', 'full', 'outer', 'reshaped' or None.

        'reshaped': a pointwise member over another shape of as many elements, at the same
        row-major position (h = x @ w + b over (B*T, C), then gelu(h.view(B, T, C)), with h
        stored for the backward: one kernel stores both). In a reduction kernel only where
        its trailing dims are the reduced ones and the rest merge or split the outer dims (a
        layer norm over (B, T, C) whose output a matrix multiply reads as (B*T, C): GPT-2's
        Conv1D), so that it is written in the stage after the reductions it reads."""
        if isinstance(buf, ir.Reduction):
            if same_sizes(buf.full_shape, self.full) and (buf.reduced == self.reduced or not self.reduced) \
                    and not self.reshaped:
                return "reduction"
            return None
        if same_sizes(_squeezed(buf.shape), _squeezed(self.full)):
            return "full"
        if self.reduced and same_sizes(_squeezed(buf.shape), _squeezed(self.outer_shape)):
            return "outer"
        if not self.reduced and same_sizes((math.prod(buf.shape),), (math.prod(self.full),)):
            return "reshaped"
        if self.reduced and self._rows_reshaped(tuple(buf.shape)):
            return "reshaped"
        return None

    def _rows_reshaped(self, shape: tuple[int, ...]) -> bool:
        """Whether `shape` is this reduction kernel's space with the reduced dims (the trailing
        ones) kept and the outer dims merged or split: its index is then the reduced loop
        variables after the outer position unravelled (_reshaped_index)."""
        n = len(self.reduced)
        if self.reduced != tuple(range(len(self.full) - n, len(self.full))) or len(shape) <= n:
            return False
        return (same_sizes(shape[-n:], self.full[-n:])
                and same_sizes((math.prod(shape[:-n]),), (math.prod(self.outer_shape),))
                and not same_sizes(_squeezed(shape), _squeezed(self.full)))


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def _fit_index(shape, sizes, index: list[Expr]) -> list[Expr]:
    """`index` (over `sizes`) as an index of `shape`, which has the same dims but for size-1 ones."""
    it = iter(e for e, s in zip(index, sizes) if s != 1)
    return [ir.const(0) if s == 1 else next(it) for s in shape]


class _Grouper:
    def __init__(self, graph: LoweredGraph):
        self.graph = graph
        self.buffers = graph.buffers
        self.group_of: dict[str, _Group] = {}
        self.position_of: dict[str, int] = {}  # buffer -> position of its producing step
        self.steps: list = []  # _Group or ir.Extern, by position
        self.kind: dict[str, str] = {}
        for name, buf in self.buffers.items():
            if isinstance(buf, ir.InputBuffer):
                self.position_of[name] = -1

    def run(self) -> list:
        for name, buf in self.buffers.items():
            if isinstance(buf, ir.InputBuffer):
                continue
            if isinstance(buf, ir.Extern):
                pos = len(self.steps)
                self.steps.append(buf)
                self.position_of[name] = pos
                for i in range(len(buf.outputs)):
                    self.position_of[buf.output_name(i)] = pos
                continue
            self.place(buf)
        return self.steps

    def place(self, buf) -> None:
        reads = buf.reads()
        groups = sorted({id(self.group_of[r]): self.group_of[r] for r in reads if r in self.group_of}.values(),
                        key=lambda g: -g.position)
        for group in groups:
            kind = group.kind_of(buf)
            if kind is None or group.device != buf.device or not group.has_room(buf):
                continue
            others = [self.position_of[r] for r in reads if self.group_of.get(r) is not group]
            if any(p >= group.position for p in others):
                continue
            if not self.reads_line_up(group, buf, kind):
                continue
            if kind == "reduction" and not group.reduced:
                group.reduced = buf.reduced
            self.join(group, buf, kind)
            return
        # a sibling: a later kernel over the same space that reads none of buf's producers' results late.
        # A single element (a batch norm's step counter) may move before extern calls it does not read
        # from, so that all of them are one kernel.
        latest_input = max((self.position_of[r] for r in reads), default=-1)
        single = math.prod(buf.full_shape if isinstance(buf, ir.Reduction) else buf.shape) == 1
        for position in range(len(self.steps) - 1, latest_input, -1):
            step = self.steps[position]
            if not isinstance(step, _Group):
                if single:
                    continue
                break
            kind = step.kind_of(buf)
            if (kind is not None and step.device == buf.device and step.has_room(buf)
                    and self.reads_line_up(step, buf, kind)):
                if kind == "reduction" and not step.reduced:
                    step.reduced = buf.reduced
                self.join(step, buf, kind)
                return
        full = buf.full_shape if isinstance(buf, ir.Reduction) else buf.shape
        reduced = buf.reduced if isinstance(buf, ir.Reduction) else ()
        group = _Group(len(self.steps), full, reduced, buf.device)
        self.steps.append(group)
        self.join(group, buf, "reduction" if reduced else "full")

    def join(self, group: _Group, buf, kind: str) -> None:
        group.members.append(buf.name)
        group.reads |= buf.reads()
        self.group_of[buf.name] = group
        self.position_of[buf.name] = group.position
        self.kind[buf.name] = kind
        group.reshaped |= kind == "reshaped"

    def reads_line_up(self, group: _Group, buf, kind: str) -> bool:
        """Reads of this kernel's reduction results must be at the reader's own outer index."""
        if not group.reduced and kind != "reduction":
            return True
        kv = KernelVars(group.full, group.reduced or buf.reduced)
        body = ir.substitute(buf.body, kv.index_of(kind, buf.full_shape if kind == "reduction" else buf.shape))
        for load in ir.loads(body):
            if self.group_of.get(load.arg) is not group or not self.after_reduction(load.arg, group):
                continue
            shape = self.buffers[load.arg].shape
            own = kv.index_of(self.kind[load.arg], shape, as_output=True)
            if [e.key() for e in load.args] != [e.key() for e in own]:
                # a reshaped reader's index unravels its position: the same element if the
                # row-major positions fold to one expression
                strides = ir.contiguous_strides(shape)
                if ir.flat_index(list(load.args), strides).key() != ir.flat_index(own, strides).key():
                    return False
        return True

    def after_reduction(self, name: str, group: _Group, seen=None) -> bool:
        buf = self.buffers[name]
        if isinstance(buf, ir.Reduction):
            return True
        return any(self.group_of.get(r) is group and self.after_reduction(r, group) for r in buf.reads())


@dataclasses.dataclass
class KernelVars:
    """The loop variables of a kernel over `full` with `reduced` dims, and each member's index in them."""

    full: tuple[int, ...]
    reduced: tuple[int, ...]
    # the outer dims from the slowest-varying loop variable to the fastest (None: in order)
    loop_order: tuple[int, ...] | None = None

    def __post_init__(self):
        self.outer_sizes = tuple(s for i, s in enumerate(self.full) if i not in self.reduced)
        self.reduced_sizes = tuple(self.full[i] for i in self.reduced)
        order = self.loop_order or tuple(range(len(self.outer_sizes)))
        self.loop_sizes = tuple(self.outer_sizes[d] for d in order)  # the kernel's x0, x1, ...
        var_of_dim = {d: k for k, d in enumerate(order)}
        self.x = [ir.const(0) if s == 1 else ir.var(f"x{var_of_dim[d]}") for d, s in enumerate(self.outer_sizes)]
        self.r = [ir.const(0) if s == 1 else ir.var(f"r{k}") for k, s in enumerate(self.reduced_sizes)]

    def full_index(self) -> list[Expr]:
        xs, rs = iter(self.x), iter(self.r)
        return [next(rs) if i in self.reduced else next(xs) for i in range(len(self.full))]

    def index_of(self, kind: str, shape, as_output: bool = False) -> list[Expr]:
        """A member's own index: a reduction's inputs range over full, its output over outer;
        a reshaped member's is the row-major position in full, unravelled over its shape."""
        if kind == "outer" or (kind == "reduction" and as_output):
            return _fit_index(shape, self.outer_sizes, self.x)
        if kind == "reshaped":
            return _reshaped_index(self.full_index(), self.full, shape)
        return _fit_index(shape, self.full, self.full_index())


def _reshaped_index(index: list[Expr], full, shape) -> list[Expr]:
    """The index into `shape` of the row-major position that `index` has in `full`: the
    trailing dims both share are the same variables; the rest unravel from their position
    (either is right: symbolic sizes share a dim where they are the same expression, unguarded)."""
    index, full, shape = list(index), list(full), list(shape)
    tail = []
    while full and shape and size_key(full[-1]) == size_key(shape[-1]):
        tail.insert(0, index.pop())
        full.pop()
        shape.pop()
    return ir.unravel(ir.flat_index(index, ir.contiguous_strides(full)), shape) + tail


# =============================================================================
# Building kernels: expand members into expressions over loop variables
# =============================================================================


class _KernelBuilder:
    def __init__(self, name: str, group: _Group, grouper: _Grouper, stored: set[str], layouts: dict):
        self.name, self.group, self.grouper = name, group, grouper
        self.buffers = grouper.buffers
        self.stored, self.layouts = stored, layouts
        self.kv = KernelVars(group.full, group.reduced, self.loop_order(group, stored, layouts))
        self.members = set(group.members)
        self.reads: dict[str, None] = {}
        self.level: dict[str, int] = {}

    def value(self, name: str, index: list[Expr]) -> Expr:
        """Member `name` at `index`, as an expression of loads of stored buffers."""
        buf = self.buffers[name]
        if isinstance(buf, ir.Reduction):
            return Expr(Op.REDUCED, buf.dtype, (), name)
        return self.expand(ir.substitute(buf.body, index))

    def expand(self, e: Expr) -> Expr:
        def leaf(node: Expr):
            if node.op is not Op.LOAD:
                return None
            if node.arg in self.members:
                return self.value(node.arg, list(node.args))
            return self.load_stored(node)

        return ir.rewrite(e, leaf)

    def load_stored(self, node: Expr) -> Expr:
        dtype, layout, _ = self.layouts[node.arg]
        self.reads[node.arg] = None
        flat = ir.flat_index(list(node.args), layout.stride, layout.offset)
        return Expr(Op.LOAD, node.dtype, (flat,), node.arg)

    def reduction_level(self, name: str) -> int:
        """0 for a reduction needing no other reduction of this kernel; deeper ones count up."""
        if name in self.level:
            return self.level[name]
        buf = self.buffers[name]
        deps = [self.reduction_level(r) + (1 if isinstance(self.buffers[r], ir.Reduction) else 0)
                for r in buf.reads() if r in self.members]
        self.level[name] = max(deps, default=0)
        return self.level[name]

    @staticmethod
    def loop_order(group: _Group, stored: set[str], layouts: dict) -> tuple[int, ...] | None:
        """A pointwise kernel iterates in the memory order of the first buffer it stores, so
        that its stores (and the loads laid out alike) are contiguous: a channels-last
        result is written channel by channel, not with a stride of the channel count."""
        if group.reduced:
            return None
        for name in group.members:
            _, layout, _ = layouts[name]
            if name in stored and layout.shape == group.full:
                order = sorted(range(len(group.full)), key=lambda d: -layout.stride[d])  # stable: ties keep order
                return tuple(order) if order != sorted(order) else None
        return None

    def build(self) -> Kernel:
        kv = self.kv
        n_stages = 0
        red_by_stage: dict[int, list] = {}
        stores_by_stage: dict[int, list] = {}
        outer_stores = []
        for name in self.group.members:
            buf = self.buffers[name]
            kind = self.grouper.kind[name]
            if kind == "reduction":
                level = self.reduction_level(name)
                value = self.expand(ir.substitute(buf.body, kv.index_of(kind, buf.full_shape)))
                red_by_stage.setdefault(level, []).append(Accumulate(name, buf.reduce_op, buf.body.dtype, value))
                n_stages = max(n_stages, level + 1)
                if name in self.stored:
                    index = kv.index_of(kind, buf.shape, as_output=True)
                    outer_stores.append(self.store(name, index, Expr(Op.REDUCED, buf.dtype, (), name)))
            elif name in self.stored:
                index = kv.index_of(kind, buf.shape)
                st = self.store(name, index, self.value(name, index))
                if kind in ("full", "reshaped") and self.group.reduced:
                    level = self.depth(name)
                    stores_by_stage.setdefault(level, []).append(st)
                    n_stages = max(n_stages, level + 1)
                else:
                    outer_stores.append(st)
        stages = tuple(Stage(tuple(red_by_stage.get(i, ())), tuple(stores_by_stage.get(i, ()))) for i in range(n_stages))
        writes = tuple(s.buffer for s in outer_stores) + tuple(s.buffer for st in stages for s in st.stores)
        return Kernel(self.name, self.group.device, kv.loop_sizes, kv.reduced_sizes if self.group.reduced else (),
                      stages, tuple(outer_stores), tuple(self.reads), writes, tuple(self.group.members))

    def depth(self, name: str) -> int:
        """The stage a full-shaped member can be stored in: after every reduction it reads."""
        buf = self.buffers[name]
        levels = [self.reduction_level(r) + 1 if isinstance(self.buffers[r], ir.Reduction) else self.depth(r)
                  for r in buf.reads() if r in self.members]
        return max(levels, default=0)

    def store(self, name: str, index: list[Expr], value: Expr) -> Store:
        dtype, layout, _ = self.layouts[name]
        return Store(name, ir.flat_index(index, layout.stride, layout.offset), value)


# =============================================================================
# The whole schedule
# =============================================================================


def _layouts(graph: LoweredGraph) -> dict:
    out = {}
    for name, buf in graph.buffers.items():
        if isinstance(buf, ir.Extern):
            for i, (dtype, layout) in enumerate(buf.outputs):
                out[buf.output_name(i)] = (dtype, layout, buf.device)
        else:
            out[name] = (buf.dtype, buf.layout, buf.device)
    return out


def inline_pointwise(graph: LoweredGraph) -> None:
    """Substitute Pointwise buffers into the bodies of their readers, so they are never
    stored: one read by exactly one Pointwise/Reduction, and one cheap to recompute
    (ir.cheap_to_recompute) read by any number of them, in any kernels; never one whose sines
    or exponentials a reader would compute again and again (ir.broadcasts_costly_math)."""
    buffers = graph.buffers
    readers: dict[str, set[str]] = {}
    for name, buf in buffers.items():
        if not isinstance(buf, ir.InputBuffer):
            for r in buf.reads():
                readers.setdefault(r, set()).add(name)
    keep = {v.root for v in graph.outputs if isinstance(v, BufferView)}
    keep |= {w.value.root for w in graph.mutated_inputs}
    inlined: set[str] = set()
    for name, buf in list(buffers.items()):
        if isinstance(buf, (ir.Pointwise, ir.Reduction)):
            if buf.reads() & inlined:
                def leaf(node):
                    if node.op is Op.LOAD and node.arg in inlined:
                        return ir.substitute(buffers[node.arg].body, list(node.args))
                    return None
                buf.body = ir.rewrite(buf.body, leaf)
        if not isinstance(buf, ir.Pointwise) or name in keep:
            continue
        users = [buffers[u] for u in readers.get(name, ())]
        if not users or not all(isinstance(u, (ir.Pointwise, ir.Reduction)) and u.device == buf.device for u in users):
            continue
        if (len(users) == 1 or ir.cheap_to_recompute(buf, buffers)) and not ir.broadcasts_costly_math(buf, users):
            inlined.add(name)
    for name in inlined:
        del buffers[name]


def schedule(graph: LoweredGraph, frees_inputs: bool = False) -> Schedule:
    """The graph's buffers grouped into kernels and extern calls, in order, each intermediate
    freed after its last reader. With `frees_inputs`, inputs too: the wrapper then takes its
    inputs in a list that it empties (wrapper.WrapperRenderer.render), so that where the
    caller keeps no other reference an input's memory goes back at its last reader: a
    backward's saved activations, as eager's autograd frees each after its node's backward."""
    inline_pointwise(graph)
    grouper = _Grouper(graph)
    steps = grouper.run()
    buffers = graph.buffers
    layouts = _layouts(graph)

    # stored: whatever is read outside the kernel that computes it
    stored: set[str] = set()
    for name, buf in buffers.items():
        if isinstance(buf, (ir.Pointwise, ir.Reduction, ir.Extern)):
            here = grouper.group_of.get(name)
            for r in buf.reads():
                if r in grouper.group_of and grouper.group_of[r] is not here:
                    stored.add(r)
    for v in list(graph.outputs) + [w.value for w in graph.mutated_inputs]:
        if isinstance(v, BufferView) and v.root in grouper.group_of:
            stored.add(v.root)

    out_steps: list = []
    kernel_count = 0
    for step in steps:
        if isinstance(step, ir.Extern):
            out_steps.append(ExternCall(step.name))
            continue
        if not any(m in stored for m in step.members):
            continue  # nothing leaves this kernel (dead code)
        kernel = _KernelBuilder(f"kernel{kernel_count}", step, grouper, stored, layouts).build()
        kernel_count += 1
        out_steps.append(kernel)

    allocated = tuple(n for n in buffers if n in stored and not isinstance(buffers[n], (ir.InputBuffer, ir.Extern)))
    steps = tuple(_with_frees(out_steps, graph, buffers, frees_inputs))
    in_place = in_place_updates(Schedule(steps, layouts, allocated, graph))
    allocated = tuple(n for n in allocated if n not in in_place)
    stored_over = stored_over_dying(Schedule(steps, layouts, allocated, graph))
    return Schedule(steps, layouts, allocated, graph, in_place, stored_over, frees_inputs)


def _step_reads(step, buffers) -> Iterable[str]:
    if isinstance(step, Kernel):
        return step.reads
    return buffers[step.name].reads()


def _step_writes(step, buffers) -> Iterable[str]:
    if isinstance(step, Kernel):
        return step.writes
    ext = buffers[step.name]
    return [ext.output_name(i) for i in range(len(ext.outputs))]


def _views_of(steps: list, buffers) -> dict[str, set[str]]:
    """{result of an extern: the buffers it may be a view of, through views of views too}."""
    views: dict[str, set[str]] = {}
    for step in steps:
        if isinstance(step, ExternCall):
            bases: set[str] = set()
            for base in buffers[step.name].viewed():
                bases |= {base} | views.get(base, set())
            if bases:
                for name in _step_writes(step, buffers):
                    views[name] = bases
    return views


def _with_frees(steps: list, graph: LoweredGraph, buffers, frees_inputs: bool = False) -> list:
    """Insert a Free after the last reader of every intermediate buffer (and input, with
    `frees_inputs`), or of the last view of it an extern made (a buffer freed while a view
    of it lives would have its memory taken over by a later buffer: the view would read
    that one's values). An input's Free only drops the wrapper's reference: its memory is
    never reused in the call (reuse takes allocated buffers alone), as the caller may hold it."""
    keep = {v.root for v in graph.outputs if isinstance(v, BufferView)}
    keep |= {w.value.root for w in graph.mutated_inputs}
    if not frees_inputs:
        keep |= {n for n, b in buffers.items() if isinstance(b, ir.InputBuffer)}
    last_use: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in list(_step_writes(step, buffers)) + list(_step_reads(step, buffers)):
            last_use[name] = i
    for view, bases in _views_of(steps, buffers).items():
        for base in bases:
            last_use[base] = max(last_use[base], last_use[view])
            if view in keep:
                keep.add(base)
    dying: dict[int, list[str]] = {}  # step -> the buffers it is the last to use, in last_use's order
    for name, last in last_use.items():
        if name not in keep:
            dying.setdefault(last, []).append(name)
    out = []
    for i, step in enumerate(steps):
        out.append(step)
        if i in dying:
            out.append(Free(tuple(dying[i])))
    return out


def in_place_updates(sched: Schedule) -> dict[str, str]:
    """{buffer: the input it is stored into} (`Schedule.in_place`, which the wrapper
    neither allocates nor copies back): a mutated input's new value written over
    the input itself, not into a new buffer copied back at the end (an optimizer step
    would allocate and copy every parameter and state tensor). Only where that cannot
    change what anything reads: the new value is the whole of a buffer a pointwise
    kernel stores, in the input's dtype and layout, not also a graph output; no step
    after that kernel reads the input or a view an extern made of it; and the kernel
    loads the input once, at the index it stores, inside the value it stores (so the
    load comes first)."""
    graph = sched.graph
    outputs = {v.root for v in graph.outputs if isinstance(v, BufferView)}
    steps = [s for s in sched.steps if not isinstance(s, Free)]
    views = _views_of(steps, graph.buffers)
    writer_of: dict[str, int] = {}
    last_read: dict[str, int] = {}  # buffer -> the last step reading it or a view of it
    for i, step in enumerate(steps):
        for name in _step_writes(step, graph.buffers):
            writer_of.setdefault(name, i)
        for r in _step_reads(step, graph.buffers):
            for read in (r, *views.get(r, ())):
                last_read[read] = i
    loads_by_kernel: dict[int, dict] = {}
    plan: dict[str, str] = {}
    writes_to = collections.Counter(w.target for w in graph.mutated_inputs)
    for write in graph.mutated_inputs:
        target, value = write.target, write.value
        name = value.root
        if (not isinstance(value, BufferView) or not value.is_root or name in outputs or target in outputs
                or name in plan or writes_to[target] != 1 or write.layout != sched.layouts[target][1]):
            continue
        if name not in sched.allocated:
            if name in writer_of and _extern_in_place(steps[writer_of[name]], name, target, graph.buffers,
                                                      sched.layouts, views) \
                    and last_read.get(target, -1) <= writer_of[name]:
                plan[name] = target
            continue
        if sched.layouts.get(target) != sched.layouts[name]:
            continue
        writer = writer_of[name]
        kernel = steps[writer]
        if not isinstance(kernel, Kernel) or kernel.is_reduction or last_read.get(target, -1) > writer:
            continue
        if id(kernel) not in loads_by_kernel:
            loads_by_kernel[id(kernel)] = _loads_by_buffer(kernel)
        if _loads_in_place(kernel, loads_by_kernel[id(kernel)], target, name):
            plan[name] = target
    return plan


# aten's functional ops whose result is their first argument updated: `op(self, ...)` is
# `self.clone().op_(...)`; weld calls `self.op_(...)` when the graph writes that result back
# into `self` (a KV cache's `index_copy_`, an index assignment).
IN_PLACE_TWINS = frozenset({"index_copy", "index_put", "index_add", "index_fill", "scatter", "scatter_add",
                            "scatter_reduce", "masked_scatter"})


def in_place_twin(target: object) -> object | None:
    """The in-place overload of an aten functional op of IN_PLACE_TWINS (aten.index_copy.default ->
    aten.index_copy_.default), or None."""
    packet = getattr(target, "overloadpacket", None)
    if packet is None or packet.__name__ not in IN_PLACE_TWINS:
        return None
    twin = getattr(torch.ops.aten, packet.__name__ + "_", None)
    return getattr(twin, target._overloadname, None) if twin is not None else None


def _extern_in_place(step, name: str, target: str, buffers, layouts, views) -> bool:
    """Whether extern `step`, whose result `name` the graph writes back whole into input
    `target`, can run as its in-place twin on `target`: its first argument is `target` whole,
    in target's layout; its result has that layout; no other argument reads target's memory."""
    if not isinstance(step, ExternCall):
        return False
    ext = buffers[step.name]
    if ext.multi or len(ext.outputs) != 1 or in_place_twin(ext.target) is None or not ext.args:
        return False
    self_arg = ext.args[0]
    if not isinstance(self_arg, ir.TensorArg) or self_arg.buffer != target or target not in layouts:
        return False
    dtype, layout, _ = layouts[target]
    if self_arg.layout != layout or ext.outputs[0] != (dtype, layout):
        return False
    others = pytree.tree_leaves((ext.args[1:], ext.kwargs))
    return not any(isinstance(a, ir.TensorArg) and (a.buffer == target or target in views.get(a.buffer, ()))
                   for a in others)


def stored_over_dying(sched: Schedule) -> dict[str, str]:
    """{buffer: the intermediate whose memory it is stored over} (`Schedule.stored_over`,
    which the wrapper gives the buffer instead of new memory): a pointwise kernel's output
    written over a buffer that the same kernel reads for the last time, as inductor's
    in-place reuse does (a convolution's output and the batch norm and ReLU after it are
    one buffer, not two). Only where no element is overwritten before it is read: the
    kernel loads the dying buffer once, at the offset where it stores the output, inside
    the stored value (`_loads_in_place`). The dying buffer is a kernel's output or a new
    tensor from an extern (a schema that returns no alias, at storage offset 0), in the
    output's dtype and on its device, and neither a view nor viewed. On the CPU only
    kernels with one output qualify: the C++ kernels take `__restrict__` pointers, so a
    second store's value must not load what the first overwrote."""
    graph = sched.graph
    allocated = set(sched.allocated)
    views = _views_of([s for s in sched.steps if not isinstance(s, Free)], graph.buffers)
    viewed = set(views) | {b for bases in views.values() for b in bases}
    taken: dict[str, str] = {}
    given: set[str] = set()  # the dying buffers taken
    for kernel, after in zip(sched.steps, sched.steps[1:]):
        if not isinstance(kernel, Kernel) or kernel.is_reduction or not isinstance(after, Free):
            continue
        outputs = [n for n in kernel.writes if n in allocated]
        if str(kernel.device).startswith("cpu") and len(kernel.writes) > 1:
            continue
        dying = [n for n in after.names if n in kernel.reads and n not in viewed and _fresh(n, sched)]
        if not outputs or not dying:
            continue
        loads = _loads_by_buffer(kernel)
        for name in outputs:
            dtype, _, device = sched.layouts[name]
            for old in dying:
                if (old not in given and sched.layouts[old][0] == dtype and sched.layouts[old][2] == device
                        and _loads_in_place(kernel, loads, old, name)):
                    taken[name] = old
                    given.add(old)
                    break
    return taken


def _fresh(name: str, sched: Schedule) -> bool:
    """Whether buffer `name` is memory of its own: a kernel's output, or an extern's result
    that the op's schema says is not an alias, at storage offset 0."""
    if name in sched.allocated:
        return True
    buf, index = ir.producer_of(name, sched.graph.buffers)
    if not isinstance(buf, ir.Extern) or index >= len(buf.outputs):
        return False
    if getattr(buf.target, "_schema", None) is None or ir.returns_alias(buf.target):
        return False
    return buf.outputs[index][1].offset == 0


def _loads_by_buffer(kernel: Kernel) -> dict[str, dict]:
    """{buffer: {key: load}} of every load in `kernel`'s stored and accumulated values."""
    values = [s.value for s in _stores(kernel)] + [a.value for stage in kernel.stages for a in stage.reductions]
    loads: dict[str, dict] = {}
    for v in values:
        for n in ir.walk(v):
            if n.op in (Op.LOAD, Op.MASKED_LOAD):
                loads.setdefault(n.arg, {})[n.key()] = n
    return loads


def _stores(kernel: Kernel) -> list[Store]:
    return [s for stage in kernel.stages for s in stage.stores] + list(kernel.outer_stores)


def _loads_in_place(kernel: Kernel, loads: dict[str, dict], target: str, name: str) -> bool:
    """Whether `kernel` (whose loads by buffer are `loads`) reads `target` by one load, at
    the offset where it stores `name`, inside the value it stores there."""
    store = next(s for s in _stores(kernel) if s.buffer == name)
    reads = loads.get(target, {})
    if len(reads) != 1:
        return False
    (load,) = reads.values()
    inside = (n for n in ir.walk(store.value) if n.op is Op.LOAD and n.arg == target)
    if load.op is not Op.LOAD or not any(n is load or n.key() == load.key() for n in inside):
        return False
    (offset,) = load.args  # a kernel's loads are at flat offsets, as its stores are
    offset, stored_at = ir.affine_terms(ir.fold_unravelled(offset)), ir.affine_terms(ir.fold_unravelled(store.index))
    return offset is not None and stored_at is not None and _nonzero(offset) == _nonzero(stored_at)


def _nonzero(terms: tuple[dict[str, int], int]) -> tuple[dict[str, int], int]:
    coefficients, constant = terms
    return {k: c for k, c in coefficients.items() if c}, constant
