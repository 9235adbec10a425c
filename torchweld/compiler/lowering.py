"""Walk an aten graph and turn each node into loop-IR buffers (ir.py), using the
per-op rules of `rules.py`; a node without a rule becomes an extern call."""
from __future__ import annotations

import dataclasses
import logging
import math
import operator

import sympy
import torch
import torch.utils._pytree as pytree
from torch._prims_common import (make_channels_last_strides_for,
                                 suggest_memory_format)

from torchweld.compiler import aliasing, ir
from torchweld.compiler.aten_graph import pure_overload
from torchweld.compiler.ir import Expr, Layout
from torchweld.compiler.op_effects import returned_storage
from torchweld.compiler.symbols import compile_kept, hint, is_symbol_size, size_key
from torchweld.runtime.seeded_rand import SEED_HIGH, SEED_LOW
from torchweld.tuning import tuning
from torchweld.write_refusals import non_overlapping_and_dense

log = logging.getLogger("torchweld.weld")
aten = torch.ops.aten


class LoweringError(Exception):
    """This graph cannot be lowered at all (not just one op): run it eagerly."""


# =============================================================================
# Values: what an fx node evaluates to during lowering
# =============================================================================


@dataclasses.dataclass(frozen=True, eq=False)
class BufferView:
    """A tensor seen as `root` (a buffer) read through `index`.

    `index` holds one Expr per root dim, over this value's d0..dN-1; it is the
    identity for a buffer itself and index arithmetic for a view. `layout` is
    where the elements sit in root's storage, when strides can say it."""

    root: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    index: tuple[Expr, ...]
    layout: Layout | None

    def read(self, index: list[Expr]) -> Expr:
        return ir.load(self.root, self.dtype, [ir.substitute(e, index) for e in self.index])

    @property
    def is_root(self) -> bool:
        return self.index == tuple(ir.dim_vars(len(self.shape))) or (
            all(a.op is ir.Op.VAR and a.arg == f"d{i}" for i, a in enumerate(self.index))
            and len(self.index) == len(self.shape)
        )


def dense_like(layout: Layout) -> Layout:
    """A dense layout of `layout`'s shape with its dims in the same order of strides
    (a channels-last view stays channels-last)."""
    order = sorted(range(len(layout.shape)), key=lambda d: (-layout.stride[d], d))
    strides, acc = [0] * len(layout.shape), 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(layout.shape[d], 1)
    return Layout(layout.shape, tuple(strides))


def meta_layout(val: torch.Tensor) -> Layout:
    """Where we store a new buffer: like eager when that is dense, else row-major (over symbols,
    decided once per layout in a compile: compile_kept)."""
    shape, stride = tuple(val.shape), tuple(val.stride())
    dense = compile_kept("dense_layouts", (shape, stride), lambda: non_overlapping_and_dense(shape, stride))
    return Layout(shape, stride) if dense else Layout.contiguous(shape)


# =============================================================================
# The graph walk
# =============================================================================


@dataclasses.dataclass(frozen=True)
class InputWrite:
    """An in-place write into a graph input or constant, which the wrapper makes after the
    graph's kernels: `value` copied into the part of `target` at `layout` (its own layout
    for the whole tensor, a view's sizes, strides and offset for a write through a view)."""

    target: str
    layout: Layout
    value: BufferView


@dataclasses.dataclass
class LoweredGraph:
    """Buffers in execution order, plus what the wrapper returns and writes back."""

    buffers: dict[str, ir.Buffer]
    input_names: list[str]
    constants: dict[str, torch.Tensor]
    outputs: list  # BufferView (stored, strided) or a Python constant
    mutated_inputs: list[InputWrite]  # in the order the graph makes them
    externs: list[str]  # one line per extern call, for logs and tests
    # outputs that eager returns as views of an input: a view object of their own, even
    # where their layout is the input's (y.view(2, 2).flatten() is not y)
    view_outputs: frozenset = frozenset()
    # input position -> the name of the symbol it is: an int argument over symbols
    # (backends/weld_symbolic.py), which the wrapper binds from it
    symbol_inputs: dict = dataclasses.field(default_factory=dict)


class GraphLowering:
    """Lowers one aten graph; `check(buffer)` raises NotImplementedError when the
    target's renderer cannot render a new buffer, which turns its node extern."""

    def __init__(self, gm: torch.fx.GraphModule, check=lambda buf: None, bias_in_kernel=lambda device: False,
                 split_reductions=lambda device: False, cuda_graphs: bool = False):
        self.gm = gm
        # whether CUDA graphs will replay the compiled graph (mode="reduce-overhead"): a kernel
        # launched from Python (Triton's launcher) then costs the host nothing at each call
        self.cuda_graphs = cuda_graphs
        self.check = check
        self.seeds: dict[torch.device, list] = {}  # device -> [seeds buffer, their views (an unbind), seeds handed out]
        # whether a reduction with few outputs and long rows on `device` runs in two steps
        # (split_plan): right for Triton kernels, which get one program per block of outputs
        self.split_reductions = split_reductions
        # whether a convolution on `device` is called without its bias, which the next
        # fused kernel adds (cuDNN convolutions add it in an extra pass of their own)
        self.bias_in_kernel = bias_in_kernel
        self.buffers: dict[str, ir.Buffer] = {}
        self.env: dict[torch.fx.Node, object] = {}
        self.input_names: list[str] = []
        self.symbol_inputs: dict[int, str] = {}
        self.constants: dict[str, torch.Tensor] = {}
        # In-place writes (aliasing.py): a base node's value after the latest write through
        # it or any of its views; how many writes it has had; the count each node's value
        # in `env` was read at (a view read at an older one is read again from the base)
        self.latest: dict[torch.fx.Node, BufferView] = {}
        self.writes_to: dict[torch.fx.Node, int] = {}
        self.read_at: dict[torch.fx.Node, int] = {}
        self.input_of: dict[torch.fx.Node, str] = {}  # placeholder or get_attr -> its input buffer
        self.input_writes: list[InputWrite] = []
        self.externs: list[str] = []
        self.addmm_folds: dict[str, tuple[ir.Pointwise, str]] = {}  # addmm -> (the sum it was, its mm)
        # equal reductions lowered once: buffers are never written after they are computed
        # (mutations rebind), so equal bodies are equal values (`var_mean` decomposes into a
        # mean and a variance that computes the same mean again). A node the graph returns
        # takes a reduction of its own: two outputs stay two tensors (op_effects.returned_storage).
        self.reductions: dict[tuple, BufferView] = {}
        self.returned = returned_storage(gm.graph)
        self._count = 0
        self.node: torch.fx.Node | None = None  # the node being lowered

    # -- naming and registration ------------------------------------------------
    def new_name(self, prefix: str = "buf") -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def add_input(self, prefix: str, t: torch.Tensor) -> BufferView:
        name = self.new_name(prefix)
        layout = Layout(tuple(t.shape), tuple(t.stride()))
        self.buffers[name] = ir.InputBuffer(name, t.dtype, layout, t.device)
        return self.value_of_buffer(name, t.dtype, layout, t.device)

    def value_of_buffer(self, name: str, dtype, layout: Layout, device) -> BufferView:
        return BufferView(name, dtype, layout.shape, device, tuple(ir.dim_vars(len(layout.shape))), layout)

    def add_pointwise(self, body: Expr, dtype: torch.dtype, shape, device, layout: Layout | None = None) -> BufferView:
        shape = tuple(shape)
        layout = layout or Layout.contiguous(shape)
        name = self.new_name()
        self.buffers[name] = ir.Pointwise(name, dtype, shape, body, device, layout)
        return self.value_of_buffer(name, dtype, layout, device)

    def number_tensor(self, value: torch.SymFloat, dtype: torch.dtype, device: torch.device) -> BufferView:
        """A float computed from symbolic sizes as a 0-d tensor of `dtype`, which the wrapper makes from
        the symbols at each call (aten.scalar_tensor: an extern of one element)."""
        name = self.new_name()
        layout = Layout((), ())
        self.buffers[name] = ir.Extern(name, aten.scalar_tensor.default, (value,), {"dtype": dtype, "device": device},
                                       ((dtype, layout),), False, device)
        self.externs.append(f"{aten.scalar_tensor.default} (a float of symbolic sizes)")
        return self.value_of_buffer(name, dtype, layout, device)

    def add_reduction(self, x: BufferView, reduced, reduce_op: ir.Op, body: Expr, dtype) -> BufferView:
        reduced = tuple(sorted(reduced))
        split = None
        if self.split_reductions(x.device):
            split = split_plan(x.shape, reduced, reduce_op, self.reads_along_kept(body, x.shape, reduced))
        if split is None:
            return self._reduction(x.shape, reduced, reduce_op, body, dtype, x.device)
        # Few outputs, long rows: one program per block of outputs leaves most of the GPU idle.
        # Reduce in two steps: partial results over rows of `factor` times fewer elements
        # (many programs), then those partial results.
        dim, factor = split
        shape = x.shape
        before = [d for d in reduced if d < dim]  # whole dims whose index picks a partial result
        kept = [d for d in range(len(shape)) if d not in reduced]
        after = [d for d in reduced if d > dim]  # whole dims each partial result reduces
        inner = shape[dim] // factor
        # the first step's full shape: (before..., factor, kept..., inner, after...): partial
        # results first, so that the kept dims vary fastest among its outputs
        partial_shape = ([shape[d] for d in before] + [factor] + [shape[d] for d in kept] + [inner]
                         + [shape[d] for d in after])
        v = ir.dim_vars(len(partial_shape))
        order = before + [None] + kept + [dim] + after
        index: list = [None] * len(shape)
        for position, d in enumerate(order):
            if d is not None and d != dim:
                index[d] = v[position]
        index[dim] = ir.iadd(ir.imul(v[len(before)], ir.const(inner)), v[len(before) + 1 + len(kept)])
        n_partial = len(before) + 1
        partial = self._reduction(tuple(partial_shape), tuple(range(n_partial + len(kept), len(partial_shape))),
                                  reduce_op, ir.substitute(body, index), body.dtype, x.device)
        return self._reduction(partial.shape, tuple(range(n_partial)), reduce_op,
                               partial.read(ir.dim_vars(len(partial.shape))), dtype, x.device)

    def known_reduction(self, x: BufferView, reduced, reduce_op: ir.Op, body: Expr, dtype, value: BufferView) -> None:
        """Make `value` what add_reduction(x, reduced, reduce_op, body, dtype) gives from now on,
        where it is that reduction computed another way (variance's shifted sum gives sum(x))."""
        key = (tuple(map(size_key, x.shape)), tuple(sorted(reduced)), reduce_op, body.key(), dtype, x.device)
        self.reductions.setdefault(key, value)

    def reads_along_kept(self, body: Expr, shape, reduced) -> bool:
        """Whether a reduction's `body` reads its rows across, contiguous along the kept dims
        (ir.contiguous_across, over its loads' offsets in their buffers). The Triton renderer
        asks the same of the scheduled kernel (codegen.triton.reads_across_rows) to shape its blocks."""
        offsets = [ir.flat_index(list(load.args), layout.stride) for load in ir.loads(body)
                   if (layout := self.layout_of(load.arg)) is not None]
        dims = [d for d in range(len(shape)) if shape[d] != 1]
        return ir.contiguous_across(offsets, [f"d{d}" for d in dims if d in reduced],
                                    [f"d{d}" for d in dims if d not in reduced])

    def layout_of(self, name: str) -> Layout | None:
        buf, index = ir.producer_of(name, self.buffers)
        if isinstance(buf, ir.Extern):
            return buf.outputs[index][1] if index < len(buf.outputs) else None
        return getattr(buf, "layout", None)

    def _reduction(self, full_shape, reduced, reduce_op: ir.Op, body: Expr, dtype, device) -> BufferView:
        key = (tuple(map(size_key, full_shape)), tuple(reduced), reduce_op, body.key(), dtype, device)
        value = None if self.node in self.returned else self.reductions.get(key)
        if value is None:
            name = self.new_name()
            red = ir.Reduction(name, dtype, tuple(full_shape), tuple(reduced), reduce_op, body, device)
            red.layout = Layout.contiguous(red.shape)
            self.buffers[name] = red
            value = self.reductions[key] = self.value_of_buffer(name, dtype, red.layout, device)
        return value

    # -- random numbers -----------------------------------------------------------
    def draw_seeds(self) -> None:
        """One aten.randint call at the graph's start per device with random ops, whose
        kernels draw the numbers themselves (Op.RAND): a seed for each random op, drawn anew
        from the device's generator at every run (so torch.manual_seed repeats a run, and each
        CUDA graph replay draws afresh). Seeds no kernel reads are dropped at the end."""
        counts: dict[torch.device, int] = {}
        for node in self.gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "call_function" and isinstance(val, torch.Tensor) \
                    and (node.target in RANDOM_OPS or draws_a_seed(node)):
                counts[val.device] = counts.get(val.device, 0) + 1
        for device, count in counts.items():
            name, views = self.new_name("seeds"), self.new_name("seed")
            self.buffers[name] = ir.Extern(
                name, aten.randint.low, (SEED_LOW, SEED_HIGH, [count]), {"dtype": torch.int64, "device": device},
                ((torch.int64, Layout.contiguous((count,))),), False, device)
            # each seed a 0-d view of its own (one aten.unbind per run), so that the kernels of
            # two layers that differ only in their seed are one source, compiled once
            self.buffers[views] = ir.Extern(
                views, aten.unbind.int, (ir.TensorArg(name, Layout.contiguous((count,))), 0), {},
                tuple((torch.int64, Layout.contiguous(())) for _ in range(count)), True, device)
            self.seeds[device] = [name, views, 0]

    def next_seed(self, device: torch.device) -> Expr:
        """The seed of the next random op on `device`: one of the seeds drawn at the start."""
        return self.next_seed_value(device).read([])

    def next_seed_value(self, device: torch.device) -> BufferView:
        """The next seed drawn at the start on `device`, as a 0-d int64 tensor (a seed the
        graph returns: the training forward's, which the backward reads again)."""
        drawn = self.seeds.get(device)
        if drawn is None:
            raise NotImplementedError(f"no seeds were drawn on {device}")
        _, views, used = drawn
        drawn[2] += 1
        return self.value_of_buffer(self.buffers[views].output_name(used), torch.int64, Layout.contiguous(()), device)

    def drop_unused_seeds(self) -> None:
        for name, views, used in self.seeds.values():
            if used == 0:
                del self.buffers[name], self.buffers[views]
            else:
                self.externs.append(f"{aten.randint.low} (the seeds of {used} random ops)")

    # -- the walk -----------------------------------------------------------------
    def run(self, example_inputs: list[torch.Tensor], output_strides: list | None = None) -> LoweredGraph:
        """`output_strides`: for each output, None or the strides the caller wants it in."""
        from torchweld.compiler import rules

        self.draw_seeds()
        placeholders = iter(example_inputs)
        outputs: list = []
        view_outputs: frozenset = frozenset()
        for node in self.gm.graph.nodes:
            self.node = node
            if node.op == "placeholder":
                value = next(placeholders)
                if isinstance(value, torch.Tensor):
                    tv = self.add_input("arg", value)
                    self.input_names.append(tv.root)
                    self.env[node] = tv
                    self.input_of[node] = tv.root
                else:
                    if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
                        self.symbol_inputs[len(self.input_names)] = str(value.node.expr)
                    self.input_names.append(None)
                    self.env[node] = value
            elif node.op == "get_attr":
                t = getattr(self.gm, node.target)
                tv = self.add_input("const", t)
                self.constants[tv.root] = t
                self.env[node] = tv
                self.input_of[node] = tv.root
            elif node.op == "call_function":
                self.env[node] = self.call_function(node, rules)
                self.read_at[node] = self.writes_to.get(aliasing.base_of(node), 0)
            elif node.op == "output":
                leaves = pytree.tree_leaves(node.args[0])
                # one value a node, so that a node returned twice is one object twice (codegen/wrapper.py)
                by_node = {a: self.output_value(a) for a in leaves if isinstance(a, torch.fx.Node)}
                outputs = [by_node[a] if isinstance(a, torch.fx.Node) else a for a in leaves]
                returned = self.tensors_by_root(leaves, outputs)
                view_outputs = frozenset(i for i, a in enumerate(leaves) if isinstance(a, torch.fx.Node)
                                         and (self.views_an_input(a, outputs[i])
                                              or self.views_another_output(a, outputs[i], returned)))
            else:
                raise LoweringError(f"unexpected {node.op} node {node.name} in an aten graph")
        self.drop_unused_seeds()
        for v in outputs:
            if isinstance(v, BufferView) and v.layout is not None:
                self.fold_addmm(v.root)
        self.settle_addmm_folds(outputs)
        outputs = [self.as_output(v) for v in outputs]
        if output_strides is not None:
            outputs = [self.in_strides(v, s) for v, s in zip(outputs, output_strides)]
        writes = [dataclasses.replace(w, value=self.as_output(w.value)) for w in self.input_writes]
        return LoweredGraph(self.buffers, self.input_names, self.constants, outputs, writes, self.externs,
                            view_outputs, self.symbol_inputs)

    def call_function(self, node: torch.fx.Node, rules):
        target = node.target
        if target is operator.getitem:
            seq, i = node.args
            return self.value(seq)[i]
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self.value)  # C++, unlike pytree
        mutated_arg = None
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            refused = aliasing.write_eager_refuses(node)
            if refused is not None:
                raise LoweringError(f"{node.name}: eager's {target} raises here ({refused})")
            target, mutated_arg = self.functional_variant(target, node), node.args[0]
            node = RuleNode(target, node.args, node.kwargs, node.meta, node.name)
        rule = rules.LOWERINGS.get(target) or rules.LOWERINGS.get(getattr(target, "overloadpacket", None))
        result = None
        if rule is not None:
            before = len(self.buffers)
            try:
                result = rule(self, node, *args, **kwargs)
                for name in list(self.buffers)[before:]:
                    refuse_traps(self.buffers[name])
                    self.check(self.buffers[name])
            except NotImplementedError as e:
                for name in list(self.buffers)[before:]:
                    del self.buffers[name]
                result = None
                self.log_extern(target, str(e))
        else:
            self.log_extern(target, "no lowering")
        if result is None:
            result = self.extern(target, args, kwargs, node)
        if isinstance(mutated_arg, (list, tuple)):  # a multi-tensor op writes each element
            for arg, element in zip(mutated_arg, result):
                self.write(arg, element)
        elif mutated_arg is not None:
            self.write(mutated_arg, result)
        return result

    def functional_variant(self, target, node):
        """`aten.relu_` -> `aten.relu`: we lower the pure op and rebind the mutated input."""
        overload = pure_overload(target)
        if overload is None:
            raise LoweringError(f"{target} mutates its input and has no functional variant")
        return overload

    # -- in-place writes (aliasing.py) ---------------------------------------------
    def value(self, node: torch.fx.Node):
        """`node`'s value now: where its base has been written in place since it was read,
        read again from the base's new value (a view taken before the write sees it)."""
        value = self.env[node]
        base = aliasing.base_of(node)
        count = self.writes_to.get(base, 0)
        if self.read_at.get(node, 0) == count:
            return value
        val = node.meta.get("val")
        if aliasing.tensor_of(node) is base:  # the base itself, or an in-place op's result, which is it
            value = self.latest[base]
        elif isinstance(val, (list, tuple)):  # the views a split or an unbind made
            value = [self.view_of(base, v, node) for v in val]
        else:
            value = self.view_of(base, val, node)
        self.env[node], self.read_at[node] = value, count
        return value

    def view_of(self, base: torch.fx.Node, val: torch.Tensor, node: torch.fx.Node) -> BufferView:
        """The view whose fake is `val` read from `base`'s latest value."""
        latest, own = self.latest[base], aliasing.own_layout(base)
        layout = aliasing.layout_in(val, aliasing.fake_of(base))
        index = aliasing.view_index(own, layout) if layout is not None and own is not None else None
        if index is None or val.dtype != latest.dtype:
            raise LoweringError(f"{node.name}, a view of {base.name} read after {base.name} is written in place, "
                                "cannot be read from its new value")
        root_index = tuple(ir.substitute(e, index) for e in latest.index)
        stored_as_base = latest.is_root and latest.layout == own  # then `layout` places it in latest's memory too
        return BufferView(latest.root, latest.dtype, tuple(val.shape), latest.device, root_index,
                           layout if stored_as_base else None)

    def write(self, node: torch.fx.Node, result: object) -> None:
        """`node`'s tensor written in place with `result`: its base's new value is `result`
        itself, or for a view, the base with the view's elements replaced (`scattered`);
        views of the base read later read that (`value`); a graph input or constant gets
        an InputWrite of `result` at the written view's place in it."""
        if not isinstance(result, BufferView):
            raise LoweringError(f"in-place update of {node.name} with {type(result).__name__}")
        base = aliasing.base_of(node)
        own = aliasing.own_layout(base)
        itself = aliasing.tensor_of(node) is base  # not a view: a constant's meta is real, the ops' fake
        layout = own if itself else aliasing.layout_in(aliasing.fake_of(node), aliasing.fake_of(base))
        whole = itself or (layout is not None and layout == own and tuple(result.shape) == tuple(own.shape))
        new = result if whole else self.scattered(base, layout, result, node)
        count = self.writes_to[base] = self.writes_to.get(base, 0) + 1
        self.latest[base] = new
        self.env[node], self.read_at[node] = result, count
        self.env[base], self.read_at[base] = new, count
        target = self.input_of.get(base)
        if target is not None:
            self.input_write(InputWrite(target, self.buffers[target].layout if whole else layout, result))

    def scattered(self, base: torch.fx.Node, layout: Layout | None, written: BufferView,
                  node: torch.fx.Node) -> BufferView:
        """`base`'s value with the elements of its view at `layout` (in its memory) replaced by `written`'s."""
        from torchweld.compiler import rules

        own, val = aliasing.own_layout(base), aliasing.fake_of(base)
        found = aliasing.scatter_index(own, layout) if own is not None and layout is not None else None
        if found is None:
            raise LoweringError(f"in-place update of {node.name}, a view of {base.name} whose elements "
                                "its strides do not place one by one")
        index, inside = found
        old = self.value(base)
        compute = rules.upcast(val.dtype)
        here = ir.dim_vars(len(own.shape))
        body = Expr(ir.Op.WHERE, compute, (inside, rules.cast(written.read(index), compute),
                                           rules.cast(old.read(here), compute)))
        new = self.add_pointwise(body, val.dtype, own.shape, old.device, meta_layout(val))
        try:
            refuse_traps(self.buffers[new.root])
            self.check(self.buffers[new.root])
        except NotImplementedError as e:
            raise LoweringError(f"in-place update of {node.name}, a view of {base.name}: {e}") from e
        return new

    def input_write(self, write: InputWrite) -> None:
        """Add `write`, dropping the earlier writes to its target that it overwrites whole."""
        whole = write.layout == self.buffers[write.target].layout
        self.input_writes = [w for w in self.input_writes
                             if w.target != write.target or not (whole or w.layout == write.layout)]
        self.input_writes.append(write)

    def views_an_input(self, node: torch.fx.Node, value: object) -> bool:
        """Whether output `node` is a view (not the tensor itself) of a graph input or constant, as
        output_value returns it."""
        base = aliasing.base_of(node)
        return (aliasing.tensor_of(node) is not base and isinstance(value, BufferView) and value.layout is not None
                and value.root == self.input_of.get(base))

    @staticmethod
    def tensors_by_root(leaves: list, outputs: list) -> dict[str, set]:
        """{buffer: the nodes of the tensor objects (aliasing.tensor_of) the outputs stored there are}."""
        found: dict[str, set] = {}
        for node, value in zip(leaves, outputs):
            if isinstance(node, torch.fx.Node) and isinstance(value, BufferView):
                found.setdefault(value.root, set()).add(aliasing.tensor_of(node))
        return found

    def views_another_output(self, node: torch.fx.Node, value: object, returned: dict[str, set]) -> bool:
        """Whether output `node` is a view (not the tensor itself) of memory that another output,
        another tensor object in eager, returns too (`returned`: tensors_by_root): `t, t.view(-1)`
        or `t, t.detach()` are two tensors, where both values would return `t`'s buffer."""
        tensor = aliasing.tensor_of(node)
        if tensor is aliasing.base_of(node) or not isinstance(value, BufferView) or value.layout is None:
            return False
        return len(returned.get(value.root, ())) > 1

    def output_value(self, node: torch.fx.Node):
        """What the graph returns for `node`: a view of a graph input (or the input itself
        after an in-place write) as a view of that input, as eager returns it; else its value."""
        value = self.value(node)
        base = aliasing.base_of(node)
        target = self.input_of.get(base)
        if target is None or not isinstance(value, BufferView) or (node is base and not self.writes_to.get(base)):
            return value
        own = self.buffers[target].layout
        itself = aliasing.tensor_of(node) is base
        layout = own if itself else aliasing.layout_in(aliasing.fake_of(node), aliasing.fake_of(base))
        if layout is None or value.dtype != self.buffers[target].dtype:
            return value
        index = aliasing.view_index(own, layout)
        if index is None:
            return value
        return BufferView(target, value.dtype, tuple(layout.shape), value.device, tuple(index), layout)

    def fold_addmm(self, name: str) -> bool:
        """Make buffer `name` one aten.addmm if it is `mm(a, b) + bias` (_addmm_terms), for a
        reader that needs it stored whole anyway: an extern, or the graph's outputs (a
        training forward saving the biased projection that a GELU reads). Whether it is."""
        root = self.buffers.get(name)
        terms = _addmm_terms(root, self.buffers) if isinstance(root, ir.Pointwise) else None
        if terms is None:
            return False
        mm, bias = terms
        args = (bias, *mm.args)
        self.buffers[name] = ir.Extern(name, aten.addmm.default, args, {}, ((root.dtype, root.layout),), False,
                                       root.device)
        self.addmm_folds[name] = (root, mm.name)
        self.externs.append(str(aten.addmm.default))
        return True

    def settle_addmm_folds(self, outputs: list) -> None:
        """Once every node is lowered: where something else reads an addmm's product too,
        put the sum back (one matrix product, not two); then remove what is dead, the
        products the addmms took over among it."""
        if not self.addmm_folds:
            return
        mms = {mm for _, mm in self.addmm_folds.values()}
        live = self.live_buffers(outputs, skip=mms)
        for name, (original, mm) in self.addmm_folds.items():
            if mm in live:
                self.buffers[name] = original
                self.externs.remove(str(aten.addmm.default))
        live = self.live_buffers(outputs, skip=mms - live)
        for name, buf in list(self.buffers.items()):
            if name not in live and (isinstance(buf, (ir.Pointwise, ir.Reduction)) or name in mms):
                del self.buffers[name]
                if name in mms:
                    self.externs.remove(str(aten.mm.default))

    def live_buffers(self, outputs: list, skip: set[str]) -> set[str]:
        """The buffers the outputs, the mutated inputs and the externs (but those in `skip`)
        read, directly or not, and those themselves."""
        live: set[str] = set()
        stack = [v.root for v in list(outputs) + [w.value for w in self.input_writes] if isinstance(v, BufferView)]
        stack += [n for n, b in self.buffers.items() if isinstance(b, ir.Extern) and n not in skip]
        while stack:
            buf, _ = ir.producer_of(stack.pop(), self.buffers)
            if buf is None or buf.name in live:
                continue
            live.add(buf.name)
            if not isinstance(buf, ir.InputBuffer):
                stack.extend(buf.reads())
        return live

    def log_extern(self, target, reason: str) -> None:
        log.debug("extern %s (%s): %s", target, self.node.name if self.node else "?", reason)

    # -- externs ------------------------------------------------------------------
    def extern(self, target, args, kwargs, node: torch.fx.Node):
        """Call the aten kernel itself; tensor arguments become stored, strided buffers."""
        call_args, call_kwargs = pytree.tree_map_only(BufferView, self.extern_arg, (args, kwargs))
        val = node.meta.get("val")
        multi = isinstance(val, (tuple, list))
        vals = list(val) if multi else [val]
        # Results that are not tensors: None (convolution_backward's grad_bias without a bias)
        # or numbers fixed by the traced shapes (cuDNN attention's max sequence lengths). The
        # call returns an empty tensor in their place, and readers get the traced value itself.
        absent = [i for i, v in enumerate(vals) if v is None or isinstance(v, _NUMBERS)] if multi else []
        constants = {i: vals[i] for i in absent}
        if absent:
            target = _NonTensorsAsEmpty(target)
            device = next(v.device for v in vals if isinstance(v, torch.Tensor))
            vals = [torch.empty(0, device=device) if i in constants else v for i, v in enumerate(vals)]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            raise LoweringError(f"{target} returns non-tensors: {val!r}")
        outputs = tuple((v.dtype, Layout(tuple(v.shape), tuple(v.stride()))) for v in vals)
        outputs = _cudnn_conv_backward_layouts(target, node, outputs)
        name = self.new_name()
        device = vals[0].device if vals else torch.device("cpu")
        ext = ir.Extern(name, target, call_args, call_kwargs, outputs, multi, device)
        self.buffers[name] = ext
        self.externs.append(str(target))
        results = [constants[i] if i in constants else self.value_of_buffer(ext.output_name(i), d, lay, device)
                   for i, (d, lay) in enumerate(outputs)]
        return results if multi else results[0]

    def extern_arg(self, v: BufferView) -> ir.TensorArg:
        """An extern's tensor argument. A matrix product plus a bias that an extern reads
        becomes one aten.addmm (cuBLAS adds the bias in its epilogue): GPT-2's query, key
        and value are then views of it, with no kernel of their own. An extern reading part
        of another pointwise result that is cheap to recompute gets a copy of just that part,
        so the result's other readers recompute it and it is never stored whole
        (schedule.inline_pointwise)."""
        if v.layout is not None and self.fold_addmm(v.root):
            return ir.TensorArg(v.root, v.layout)
        root = self.buffers.get(v.root)
        if (isinstance(root, ir.Pointwise) and math.prod(v.shape) < math.prod(root.shape)
                and ir.cheap_to_recompute(root, self.buffers)):
            layout = dense_like(v.layout) if v.layout is not None else None
            v = self.add_pointwise(v.read(ir.dim_vars(len(v.shape))), v.dtype, v.shape, v.device, layout)
        return ir.TensorArg(*self.stored_strided(v))

    def stored_strided(self, v: BufferView) -> tuple[str, Layout]:
        """(root, layout) with `v`'s elements at `layout` in root; copies when no strides say it."""
        if v.layout is None:
            v = self.materialize(v)
        return v.root, v.layout

    def materialize(self, v: BufferView) -> BufferView:
        return self.add_pointwise(v.read(ir.dim_vars(len(v.shape))), v.dtype, v.shape, v.device)

    def in_strides(self, v: object, strides: tuple[int, ...] | None) -> object:
        """Output `v` laid out with `strides` (copied when its own differ outside size-1 dims)."""
        if strides is None or not isinstance(v, BufferView) or len(strides) != len(v.shape):
            return v
        if all(n == 1 or a == b for n, a, b in zip(v.shape, v.layout.stride, strides)):
            return v
        return self.add_pointwise(v.read(ir.dim_vars(len(v.shape))), v.dtype, v.shape, v.device,
                                  Layout(v.shape, tuple(strides)))

    def as_output(self, v: object) -> object:
        if isinstance(v, BufferView) and v.layout is None:
            return self.materialize(v)
        return v


def refuse_traps(buf: ir.Buffer) -> None:
    """Raise NotImplementedError (the node then calls aten) where `buf`'s body holds an
    integer division that could trap in a kernel (ir.trapping_division)."""
    if isinstance(buf, (ir.Pointwise, ir.Reduction)):
        node = ir.trapping_division(buf.body)
        if node is not None:
            raise NotImplementedError(f"integer {node.op.name} by a divisor that may be 0 or -1 "
                                      "(a kernel would trap where aten raises ZeroDivisionError or wraps)")


def _addmm_terms(root: ir.Pointwise, buffers: dict) -> tuple[ir.Extern, ir.TensorArg] | None:
    """(the mm extern, the bias) where `root` is `mm(a, b) + bias` (addmm's decomposition,
    compiler/decompositions.py) over contiguous 2-D layouts, so that one aten.addmm computes
    it, with a 1-D bias: an input, or a buffer computed in the graph (autocast's bfloat16 copy
    of a float32 bias: a few thousand elements, then stored, where the sum's kernel would read
    and write the whole product again). A half-precision sum adds in float32 (its terms
    upcast); aten's addmm rounds once, as eager's addmm and linear do (a product and a sum
    written apart round twice in eager: within a unit of the last place). Else None."""
    if len(root.shape) != 2 or root.layout != Layout.contiguous(root.shape) or root.body.op is not ir.Op.ADD:
        return None
    d0, d1 = (d.key() for d in ir.dim_vars(2))
    mm = bias = None
    for term in root.body.args:
        if root.dtype in (torch.float16, torch.bfloat16) and term.op is ir.Op.CAST and term.dtype is torch.float32:
            term = term.args[0]
        if term.dtype != root.dtype:
            return None
        producer = buffers.get(term.arg) if term.op is ir.Op.LOAD else None
        index = tuple(i.key() for i in term.args)
        if (isinstance(producer, ir.Extern) and producer.target is aten.mm.default and index == (d0, d1)
                and producer.outputs[0][1] == root.layout):
            mm = producer
        elif (isinstance(producer, (ir.InputBuffer, ir.Pointwise)) and index == (d1,) and producer.layout is not None
              and producer.layout.shape == root.shape[1:]):
            bias = ir.TensorArg(producer.name, producer.layout)
    if mm is None or bias is None:
        return None
    return mm, bias


# Random ops whose numbers the kernels draw themselves (rules.rand; bernoulli_ as its
# functional variant); any other runs as aten's.
RANDOM_OPS = frozenset({aten.rand_like.default, aten.rand.default, aten.bernoulli.p, aten.bernoulli_.float})


def draws_a_seed(node) -> bool:
    """Is `node` a seed drawn for seeded_rand (runtime/seeded_rand.py): one int64 over all of
    int64? The graph takes it from the seeds drawn at its start (rules.seed)."""
    return (node.target is aten.randint.low and list(node.args) == [SEED_LOW, SEED_HIGH, []]
            and node.kwargs.get("dtype") is torch.int64 and node.kwargs.get("generator") is None)


SPLIT_OPS = frozenset({ir.Op.SUM, ir.Op.MAX, ir.Op.MIN})  # associative: partial results combine


def split_plan(shape, reduced: tuple[int, ...], reduce_op: ir.Op, along_kept: bool) -> tuple[int, int] | None:
    """(reduced dim, factor) to reduce in two steps, or None for one step.

    The first step reduces rows `factor` times (and all reduced dims before `dim` times) shorter
    into partial results, the second those. Batch norm's statistics in training (sums over
    N, H, W per channel: 64 to 1024 outputs, rows of N*H*W) and a layer norm's weight gradient
    (768 outputs, rows of batch*sequence) are the cases in point. `along_kept`: the rows are
    read across, contiguous along the outputs (lowering's reads_along_kept)."""
    if reduce_op not in SPLIT_OPS or not reduced:
        return None
    # over symbols: decided at the compiled call's sizes (either answer computes the same), and only
    # a dim of a fixed size is cut (its factor must divide it at every size)
    outputs = hint(math.prod(s for i, s in enumerate(shape) if i not in reduced))
    row = hint(math.prod(shape[d] for d in reduced))
    aimed = tuning.partial_outputs_across if along_kept else tuning.partial_outputs
    wanted = min(aimed // max(outputs, 1), row // tuning.partial_row_min)
    least = tuning.split_min_elements_across if along_kept else tuning.split_min_elements
    if outputs * row < least or wanted < 4:
        return None
    best, before = None, 1  # the most partial results, at most `wanted`
    for d in reduced:
        if is_symbol_size(shape[d]):
            break
        factor = next(f for f in range(min(shape[d], wanted // before), 0, -1) if shape[d] % f == 0)
        if factor > 1 and (best is None or before * factor > best[0]):
            best = (before * factor, d, factor)
        before *= shape[d]
        if before > wanted:
            break
    if best is None or best[0] < 4:
        return None
    return best[1], best[2]


def _cudnn_conv_backward_layouts(target, node: torch.fx.Node, outputs: tuple) -> tuple:
    """The layouts cuDNN gives convolution_backward's gradients: channels-last when the input
    or the weight is. torch before 2.12 guessed them from grad_output in its meta kernel, so
    the trace said one layout and the kernel returned another (and the wrapper copied)."""
    if target is not aten.convolution_backward.default:
        return outputs
    input_, weight = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[1:3])
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.dim() == 4 for t in (input_, weight)):
        return outputs
    if torch.channels_last not in (suggest_memory_format(input_), suggest_memory_format(weight)):
        return outputs
    fixed = list(outputs)
    for i in (0, 1):  # grad_input, grad_weight
        dtype, layout = outputs[i]
        if len(layout.shape) == 4 and math.prod(layout.shape) > 0:
            fixed[i] = (dtype, Layout(layout.shape, tuple(make_channels_last_strides_for(layout.shape))))
    return tuple(fixed)


_EMPTY: dict[torch.device, torch.Tensor] = {}


_NUMBERS = (int, float, bool)  # plain values of static shapes; a symbolic one stays unsupported


@dataclasses.dataclass(frozen=True)
class _NonTensorsAsEmpty:
    """An aten op some of whose results are not tensors (None, numbers), returning empty
    tensors there instead: one per device, shared (nothing can be written into it, and the
    wrapper drops it at once)."""

    op: object

    def __call__(self, *args, **kwargs):
        out = self.op(*args, **kwargs)
        device = next(o.device for o in out if isinstance(o, torch.Tensor))
        empty = _EMPTY.get(device)
        if empty is None:
            empty = _EMPTY[device] = torch.empty(0, device=device)
        return tuple(o if isinstance(o, torch.Tensor) else empty for o in out)

    def __str__(self) -> str:
        return str(self.op)


@dataclasses.dataclass(frozen=True)
class RuleNode:
    """What a rule reads of a node, for a node the rule sees differently: an in-place
    node as its functional variant, one element of a multi-tensor op."""

    target: object
    args: tuple
    kwargs: dict
    meta: dict
    name: str


def lower(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> LoweredGraph:
    return GraphLowering(gm).run(example_inputs)
