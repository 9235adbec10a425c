"""Render the Python function that runs one graph: it checks input layouts,
allocates (and reuses) buffers, launches the kernels, calls the externs, frees
what is dead and returns the outputs.

CPU intermediates are kept from one call to the next (`_take` / `_workspace`):
torch has no caching allocator for the CPU, and glibc hands large freed blocks
back to the kernel, so every call would fault their pages in again (a transformer
block's training step: 1300 page faults, 2-3 ms of 40). A graph holds its
intermediates' peak between calls, as inductor's and ONNX Runtime's arenas do."""
from __future__ import annotations

import collections
import math
import re

import torch
import torch.utils._pytree as pytree

from torchweld.compiler import ir
from torchweld.compiler.codegen.bindings import fast_callable
from torchweld.compiler.ir import Layout
from torchweld.compiler.lowering import BufferView
from torchweld.compiler.schedule import ExternCall, Free, Kernel, Schedule, in_place_twin
from torchweld.compiler.symbols import compile_kept, size_key, size_text, sizes_text, symbols_read
from torchweld.runtime.write_back import groups_by_dtype

PRELUDE = '''
def _restride(t, shape, stride):
    """`t` in the layout the kernels were generated for: a view when only size-1 dims differ, else a copy."""
    if all(n == 1 or a == b for n, a, b in zip(shape, t.stride(), stride)):
        return t.as_strided(shape, stride)
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out
def _take(workspace, shape, stride, dtype, device):
    """The buffer an earlier call left in `workspace`, or a new one (a list: pop and append are atomic);
    a new one too where the earlier call's had other sizes (a graph over symbolic sizes)."""
    try:
        t = workspace.pop()
    except IndexError:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if t.shape != shape or t.stride() != stride:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return t
'''


def _storage_size(layout: Layout) -> object:
    """The elements `layout` spans (symbols.size_key of it, where sizes are symbols; computed
    once per layout in a compile over symbols, each a few sympy operations)."""
    return compile_kept("storage_size", (layout.shape, layout.stride, layout.offset), lambda: _span(layout))


def _span(layout: Layout) -> object:
    if 0 in layout.shape:
        return 0
    return size_key(layout.offset + 1 + sum((s - 1) * st for s, st in zip(layout.shape, layout.stride)))


def _placed(layout: Layout) -> str:
    """`layout`'s shape and strides as a call's two arguments (symbolic sizes as Python over the symbols)."""
    return f"{sizes_text(layout.shape)}, {sizes_text(layout.stride)}"


def launch_token(kind: str, kernel: str) -> str:
    """Where a kernel's launch line goes in a rendered wrapper (`fill_launches` puts it there):
    its line through Triton's JIT or a C++ kernel (`jit`), or through its compiled launcher,
    where it has one (`fast`). A wrapper rendered once with tokens takes lines made later:
    the graph cache (graph_cache.py) keeps the rendered text and makes the fast lines anew."""
    return f"@{kind}:{kernel}@"


_TOKEN = re.compile(r"@(jit|fast):(\w+)@")


def fill_launches(template: str, jit: dict[str, str], fast: dict[str, str]) -> str:
    """`template` with each token replaced by its kernel's line (a fast token by the jit line
    of a kernel with no fast one)."""
    def line(m: re.Match) -> str:
        kind, kernel = m[1], m[2]
        return (fast.get(kernel) or jit[kernel]) if kind == "fast" else jit[kernel]

    return _TOKEN.sub(line, template)


class WrapperRenderer:
    """Python source for `call(*inputs)`; `constants` holds objects the source refers to by
    name, and `origins` the operator or function each extern's callable is made from."""

    def __init__(self, sched: Schedule):
        self.sched = sched
        self.graph = sched.graph
        self.constants: dict[str, object] = {}
        self.origins: dict[str, object] = {}
        self._names: dict[tuple, str] = {}  # a constant's key -> its name
        self.lines: list[str] = []
        self.binds_symbols = False  # (render: the function reads symbolic sizes from its inputs)

    def const(self, value: object) -> str:
        """Source text for a constant argument: a literal when it prints as one, else a global."""
        if value is None or isinstance(value, (bool, int, str)):
            return repr(value)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):  # computed from the symbols bound
            return size_text(value)  # (never kept as an object: its value would be the compiled call's)
        if isinstance(value, float):
            return repr(value) if math.isfinite(value) else f"float('{value}')"
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, (list, tuple)):
            inner = ", ".join(self.const(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {self.const(v)}" for k, v in value.items()) + "}"
        if isinstance(value, ir.TensorArg):
            return self.tensor(value.buffer, value.layout)
        try:  # one name for equal values (a device), in every function rendered
            key = (type(value), value)
            hash(key)
        except TypeError:
            key = ("id", id(value))
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = f"_c{len(self.constants)}"
            self.constants[name] = value
        return name

    def tensor(self, root: str, layout: Layout) -> str:
        _, own, _ = self.sched.layouts[root]
        if own == layout:
            return root
        if layout.offset == 0:  # as_strided keeps the base's own storage offset when given none
            return f"{root}.as_strided({_placed(layout)})"
        return self.view(root, layout)

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def render(self, name: str, kernel_launch, check_alignment=(), stream_index: int | None = None,
               boxed: bool = False) -> str:
        """Source of `def <name>(*inputs)`. `kernel_launch(kernel)` is a kernel's line (None: no work).

        With `check_alignment`, the function first hands the call to `call_jit`
        when one of those inputs is not 16-byte aligned; with `stream_index`, it
        reads that device's current CUDA stream into `_stream` for the launches.
        `boxed`: `def <name>(_inputs)`, taking the inputs in a list that it empties, so
        that, where the caller keeps no other reference, each input's memory goes back at
        its last reader (the schedule's frees_inputs) or at once if nothing reads it."""
        g = self.graph
        params = [n if n is not None else f"_number{i}" if i in g.symbol_inputs else f"_unused{i}"
                  for i, n in enumerate(g.input_names)]
        self.read = self.buffers_read()
        if boxed:
            self.lines = [f"def {name}(_inputs):"]
            if params:
                self.emit(f"{', '.join(params)}{',' if len(params) == 1 else ''} = _inputs")
            self.emit("_inputs.clear()")
        else:
            self.lines = [f"def {name}({', '.join(params)}):"]
        reads = {symbol: f"_number{i}" for i, symbol in g.symbol_inputs.items()}
        reads |= symbols_read([(n, self.sched.layouts[n][1].shape) for n in params if n in self.sched.layouts])
        self.binds_symbols = bool(reads)
        for symbol, read in reads.items():
            self.emit(f"{symbol} = {read}")
        if check_alignment:
            pointers = " | ".join(f"{n}.data_ptr()" for n in check_alignment)
            self.emit(f"if ({pointers}) & 15: return call_jit({', '.join(params)})")
        unread = [p for p in params if p not in self.read] if boxed else []
        if unread:
            self.emit(f"del {', '.join(unread)}")
        if stream_index is not None:
            self.emit(f"_ensure_context({stream_index})")
            self.emit(f"_stream = _raw_stream({stream_index})")
        targets = {w.target for w in g.mutated_inputs}
        for name in params:
            if name in self.sched.layouts and name not in unread:
                dtype, layout, _ = self.sched.layouts[name]
                if name in targets:  # the caller's tensor, which a restrided copy is copied back into
                    self.emit(f"_caller_{name} = {name}")
                self.emit(f"if {name}.stride() != {sizes_text(layout.stride)}: "
                          f"{name} = _restride({name}, {_placed(layout)})")
        for name in g.constants:
            self.constants[name] = g.constants[name]
        allocated = set(self.sched.allocated)
        takes_over = self.reuse_plan()
        reused = set(takes_over.values())
        stored_over_dying = set(self.sched.stored_over.values())
        first = self.first_of_chains(takes_over)
        in_place = self.sched.in_place
        for step in self.sched.steps:
            if isinstance(step, Kernel):
                for name in step.writes:
                    if name in in_place:
                        self.emit(f"{name} = {in_place[name]}  # updated in place")
                    elif name in allocated:
                        self.allocate(name, takes_over.get(name), first)
                line = kernel_launch(step)
                if line:
                    self.emit(line)
            elif isinstance(step, ExternCall):
                self.extern(g.buffers[step.name])
            elif isinstance(step, Free):
                for name in step.names:
                    if name in stored_over_dying:  # its memory lives on as the buffer stored over it
                        self.emit(f"del {name}")
                        continue
                    if name in reused:
                        continue  # its name went where a new buffer took its memory
                    if name in first:  # its memory waits in the workspace for the next call
                        origin = first[name]
                        _, layout, _ = self.sched.layouts[origin]
                        self.emit(f"_workspace_{origin}.append({self.tensor(name, layout)})")
                    self.emit(f"del {name}")
        self.write_back(in_place, params)
        outs = []
        views: dict[int, str] = {}  # id(a view output) -> its local: one object where the graph returns it twice
        for i, v in enumerate(g.outputs):
            if i not in g.view_outputs:
                outs.append(self.output(v))
                continue
            if id(v) not in views:
                views[id(v)] = f"_view{len(views)}"
                self.emit(f"{views[id(v)]} = {self.view(v.root, v.layout)}")
            outs.append(views[id(v)])
        self.emit(f"return ({', '.join(outs)}{',' if len(g.outputs) == 1 else ''})")
        return "\n".join(self.lines) + "\n"

    def write_back(self, in_place: dict[str, str], params: list[str]) -> None:
        """The graph's in-place writes into its inputs and constants (lowering.InputWrite), those
        its kernels did not make in place: each whole tensor written once by one multi-tensor
        copy per dtype; writes through views, and several to one tensor, in the graph's order."""
        g = self.graph
        writes = [w for w in g.mutated_inputs if in_place.get(w.value.root) != w.target]
        count = collections.Counter(w.target for w in writes)
        whole = [w for w in writes if count[w.target] == 1 and w.layout == self.sched.layouts[w.target][1]]
        for group in groups_by_dtype([self.sched.layouts[w.target][0] for w in whole]):
            targets = [whole[i].target for i in group]
            values = [self.output(whole[i].value) for i in group]
            if len(group) == 1:
                self.emit(f"{targets[0]}.copy_({values[0]})")
            else:
                self.emit(f"torch._foreach_copy_([{', '.join(targets)}], [{', '.join(values)}])")
        for w in writes:
            if w not in whole:
                self.emit(f"{self.tensor(w.target, w.layout)}.copy_({self.output(w.value)})")
        for name in dict.fromkeys(w.target for w in g.mutated_inputs):
            if name in params:  # an input the call restrided into a copy: the caller's tensor gets its new value
                self.emit(f"if {name}.data_ptr() != _caller_{name}.data_ptr(): _caller_{name}.copy_({name})")

    def buffers_read(self) -> set[str]:
        """Buffers that a kernel or an extern call reads, or the call returns or writes back."""
        g = self.graph
        read = {name for step in self.sched.steps if isinstance(step, Kernel) for name in step.reads}
        for step in self.sched.steps:
            if isinstance(step, ExternCall):
                ext = g.buffers[step.name]
                for a in pytree.tree_leaves([ext.args, ext.kwargs]):
                    if isinstance(a, ir.TensorArg):
                        read.add(a.buffer)
        values = [*g.outputs, *(w.value for w in g.mutated_inputs)]
        return read | {v.root for v in values if isinstance(v, BufferView)} | {w.target for w in g.mutated_inputs}

    def reuse_plan(self) -> dict[str, str]:
        """{new buffer: the buffer whose memory it takes over}: the one dying in the kernel
        that writes it (`Schedule.stored_over`), or else a dead one of the same dtype, device
        and storage size, the last freed first. A dead buffer no allocation takes is
        deleted where it dies (kept for later, it would hold its memory until the call returns)."""
        pool: dict[tuple, list[str]] = {}
        plan: dict[str, str] = {}
        allocated = set(self.sched.allocated)
        stored_over = self.sched.stored_over
        dying_taken = set(stored_over.values())
        for step in self.sched.steps:
            if isinstance(step, Kernel):
                for name in step.writes:
                    if name in stored_over:
                        plan[name] = stored_over[name]
                    elif name in allocated and pool.get(self.pool_key(name)):
                        plan[name] = pool[self.pool_key(name)].pop()
            elif isinstance(step, Free):
                for name in step.names:
                    if name in allocated and name not in dying_taken:
                        pool.setdefault(self.pool_key(name), []).append(name)
        return plan

    def first_of_chains(self, takes_over: dict[str, str]) -> dict[str, str]:
        """{CPU buffer: the first buffer of its chain of reuses} for the chains whose last
        buffer is freed in the call (not returned): the memory the workspace keeps."""
        first = {}
        for step in self.sched.steps:
            if isinstance(step, Kernel):
                for name in step.writes:
                    if name in self.sched.allocated and str(self.sched.layouts[name][2]).startswith("cpu"):
                        old = takes_over.get(name)
                        # a chain that begins in an extern's result is that result's memory, not the workspace's
                        first[name] = name if old is None else first.get(old)
        freed = {n for step in self.sched.steps if isinstance(step, Free) for n in step.names}
        kept = {origin for name, origin in first.items() if name in freed and name not in takes_over.values()}
        return {name: origin for name, origin in first.items() if origin is not None and origin in kept}

    def pool_key(self, name: str) -> tuple:
        dtype, layout, device = self.sched.layouts[name]
        return (dtype, str(device), _storage_size(layout))

    def allocate(self, name: str, old: str | None, first: dict[str, str]) -> None:
        """`name` in the memory of dead buffer `old`, or newly allocated where None (from
        the workspace where `name` begins a chain in `first`)."""
        dtype, layout, device = self.sched.layouts[name]
        if old is not None:
            # a buffer dying in this kernel is still read by it: its name goes at its Free
            drop = "" if self.sched.stored_over.get(name) == old else f"; del {old}"
            if self.sched.layouts[old][1] == layout:
                self.emit(f"{name} = {old}{drop}  # reuse")
            else:
                self.emit(f"{name} = {old}.as_strided({_placed(layout)}){drop}  # reuse")
            return
        if first.get(name) == name:
            self.constants.setdefault(f"_workspace_{name}", [])
            self.emit(f"{name} = _take(_workspace_{name}, {_placed(layout)}, {dtype}, "
                      f"{self.const(torch.device(device))})")
            return
        self.emit(f"{name} = torch.empty_strided({_placed(layout)}, dtype={dtype}, "
                  f"device={self.const(torch.device(device))})")

    def extern(self, ext: ir.Extern) -> None:
        in_place = ext.name in self.sched.in_place  # its result is its first argument, updated
        origin = in_place_twin(ext.target) if in_place else ext.target
        target = self.const(fast_callable(origin))
        self.origins[target] = origin
        args = ", ".join(self.const(a) for a in ext.args)
        kwargs = ", ".join(f"{k}={self.const(v)}" for k, v in ext.kwargs.items())
        call = f"{target}({', '.join(x for x in (args, kwargs) if x)})"
        names = [ext.output_name(i) for i in range(len(ext.outputs))]
        lhs = ", ".join(names) + ("," if ext.multi and len(names) == 1 else "")
        if ext.multi and not names:
            lhs = "_"
        self.emit(f"{lhs} = {call}  # extern")
        for name, (dtype, layout) in zip(names, ext.outputs):
            # Only results something reads: one nothing reads may not even have its traced
            # shape (cuDNN attention's logsumexp is empty where the trace says [b, h, s, 1]).
            if name in self.read:
                self.emit(f"if {name}.stride() != {sizes_text(layout.stride)}: "
                          f"{name} = _restride({name}, {sizes_text(layout.shape)}, {sizes_text(layout.stride)})")

    def view(self, root: str, layout: Layout) -> str:
        """A new view of `root` at `layout`, whatever root's own layout is."""
        return f"{root}.as_strided({_placed(layout)}, {root}.storage_offset() + {size_text(layout.offset)})"

    def output(self, value: object) -> str:
        if isinstance(value, BufferView):
            return self.tensor(value.root, value.layout)
        return self.const(value)
