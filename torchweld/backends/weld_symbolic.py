"""weld for a graph with symbolic sizes: one compile for every size, where weld's compiler can.

Capture hands weld a graph whose sizes are symbols of capture's ShapeEnv. weld compiles it
over symbols of a ShapeEnv of its own, one for each of capture's (`SymbolicCopy`), with the
call's sizes as their hints: the trace to aten, the lowering, the schedule and the code
generation compute with these SymInts, and wherever one of them decides something from a
size (`if numel > 1024`), the ShapeEnv answers from what it can prove, or from the hint and
then records the answer as a guard. The compiled graph holds on the calls where those guards
hold (`WeldGuard`, checked before each call from the symbols' values); another call, or a graph
whose compile made a symbol a number (`int(size)` somewhere: no gain over a compile per size),
goes to the compile per size (weld_sizes.py), as does a graph weld cannot compile so (an
op or a decision its code does not take symbolically: `SymbolicCompileError`).

Kernels take the sizes that are symbols, or expressions of them, as arguments (`ks0`, `ks1`:
codegen/size_args.py); the wrapper binds each symbol from an input's size at each call
(`s27 = arg1.size(0)`) and computes from them what depends on them: those arguments,
allocations, strides, extern calls' sizes, Triton grids (compiler/symbols.py). Choices that
any answer makes right (block sizes, fusion, recomputing an operand) take no guard: they are
made at the hint, or by comparing expressions. A training graph compiles so too (the joint
trace, the partition, forward and backward: autograd/training.py's _compiled_over_symbols).
An int argument that capture made a symbol is one of weld's too, read from the argument.
Shortcuts: a graph that uses a float computed from sizes other than as an operand of `+ - *`
(lowering's number_tensor) or of an extern call is compiled per size.
"""
from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._mode_utils import no_dispatch

from torchweld import logs
from torchweld.backends.module_settings import read_settings
from torchweld.backends.weld_declines import is_symbolic
from torchweld.capture.symbolic_sizes import SYMBOLIC_TYPES, CaptureShapeEnv, IntSource, SizeSource, python_text
from torchweld.fake_tensors import meta_on_fresh_storage, over_symbols, storage_elements


class SymbolicCompileError(Exception):
    """This graph cannot be compiled over symbols; it is compiled per size."""


class SymbolicCopy:
    """A copy of a captured graph whose example values are fakes over a ShapeEnv of weld's own.

    `symbols`: weld's symbol -> (input position, dim) where a call's value of it is read
    (dim None: the input is the number itself).
    `inputs`: the example inputs to compile with (fakes of `mode`; numbers and static
    tensors as given)."""

    def __init__(self, gm: torch.fx.GraphModule, args: tuple):
        self.env = CaptureShapeEnv()  # (whose guards name no stack: torch's walk of it imports its own compiler)
        self.env.user_location = lambda: "weld's compile over symbols"
        self.mode = over_symbols(FakeTensorMode(allow_non_fake_inputs=True), self.env)
        self._renamed: dict = {}  # capture's symbol -> weld's
        self._hints: dict = {}  # capture's symbol -> its value in this call
        self._ints: dict = {}  # (type, capture's expression) -> weld's number (int_of)
        self._storages: dict = {}  # (dtype, weld's sizes and strides) -> a storage's elements (_fake_of)
        self.symbols: dict = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, (node, arg) in enumerate(zip(placeholders, args)):
            fake = node.meta.get("example_value")
            if isinstance(fake, torch.SymInt) and type(arg) is int:
                self._name_number(i, fake, arg)
            elif isinstance(fake, SYMBOLIC_TYPES) or not isinstance(arg, torch.Tensor) and is_symbolic(fake):
                raise SymbolicCompileError(f"a symbolic {type(fake).__name__} among the graph's inputs")
            if isinstance(fake, torch.Tensor) and isinstance(arg, torch.Tensor):
                self._name_symbols(i, fake, arg)
        self.inputs = [self._fake_input(n.meta.get("example_value"), a) for n, a in zip(placeholders, args)]
        self.gm = self._copy(gm)

    def _name_number(self, position: int, fake: torch.SymInt, value: int) -> None:
        """An int argument that capture made a symbol (a count passed in, a size a resume
        function receives): a symbol of any sign, 0 and 1 too, read from the argument itself."""
        expr = fake.node.shape_env.replace(fake.node.expr)
        if expr.is_number or expr in self._renamed:  # (a number capture fixed: an int to weld)
            return
        if not isinstance(expr, sympy.Symbol):
            raise SymbolicCompileError(f"int argument {position} is the expression {expr}")
        ours = self.env.create_unspecified_symbol(value, IntSource(f"arg{position}"), dynamic_dim=DimDynamic.DYNAMIC)
        self._renamed[expr] = ours
        self._hints[expr] = value
        self.symbols[ours] = (position, None)

    def _name_symbols(self, position: int, fake: torch.Tensor, real: torch.Tensor) -> None:
        for d, size in enumerate(fake.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.shape_env.replace(size.node.expr)
            if isinstance(expr, sympy.Symbol) and expr not in self._renamed:
                value = real.shape[d]
                ours = self.env.create_symbol(value, SizeSource(f"arg{position}", d), dynamic_dim=DimDynamic.DYNAMIC)
                if not isinstance(ours, sympy.Symbol):
                    raise SymbolicCompileError(f"size {value} of input {position} is not made a symbol")
                bounds = size.node.shape_env.var_to_range.get(expr)
                if bounds is not None:
                    self.env.constrain_symbol_range(ours, compiler_min=int(bounds.lower),
                                                    compiler_max=bounds.upper if bounds.upper.is_finite else None)
                self._renamed[expr] = ours
                self._hints[expr] = value
                self.symbols[ours] = (position, d)

    def int_of(self, n: object) -> object:
        """Capture's size `n` as weld's: an int, or a SymInt of weld's ShapeEnv (a float computed
        from sizes, `n ** 0.5`: a float or a SymFloat)."""
        if not isinstance(n, (torch.SymInt, torch.SymFloat)):
            if isinstance(n, SYMBOLIC_TYPES):
                raise SymbolicCompileError(f"a symbolic {type(n).__name__} in the graph")
            return n
        expr = n.node.shape_env.replace(n.node.expr)
        key = (type(n), expr)  # (a graph's sizes repeat: GPT-2's 500 fakes name ~10 expressions)
        if key not in self._ints:
            self._ints[key] = self._renamed_number(n, expr)
        return self._ints[key]

    def _renamed_number(self, n: object, expr: sympy.Expr) -> object:
        if expr.free_symbols - set(self._renamed):
            raise SymbolicCompileError(f"the size {expr} names a symbol no input size brings")
        ours = expr.xreplace(self._renamed)
        value = expr.xreplace({s: sympy.Integer(v) for s, v in self._hints.items()})
        if isinstance(n, torch.SymFloat):
            return float(ours) if ours.is_number else self.env.create_symfloatnode(ours, hint=float(value))
        return int(ours) if ours.is_number else self.env.create_symintnode(ours, hint=int(value))

    def _fake_of(self, value: torch.Tensor) -> torch.Tensor:
        """A fake of `mode` with `value`'s sizes and strides in weld's symbols, made directly
        rather than dispatched through the mode (an empty tensor: nothing to compute, and
        symbolic sizes make each dispatch cost ~0.5 ms); a repeat of sizes and strides as
        as_strided of a storage of the elements the first one's had, which computes no storage
        size over symbols (as fake_memo._rebuild)."""
        sizes = [self.int_of(n) for n in value.shape]
        strides = [self.int_of(n) for n in value.stride()]
        key = (value.dtype, *(n.node.expr if isinstance(n, torch.SymInt) else n for n in (*sizes, None, *strides)))
        elements = self._storages.get(key)
        with no_dispatch():
            if elements is None:
                meta = torch.empty_strided(sizes, strides, dtype=value.dtype, device="meta")
                self._storages[key] = storage_elements(meta)
            else:
                meta = meta_on_fresh_storage(elements, sizes, strides, 0, value.dtype)
        fake = FakeTensor(self.mode, meta, value.device)
        if value.requires_grad:
            fake.requires_grad_(True)
        return fake

    def _fake_input(self, fake: object, arg: object) -> object:
        if isinstance(fake, torch.Tensor) and isinstance(arg, torch.Tensor) and is_symbolic(fake):
            return self._fake_of(fake)
        if isinstance(fake, torch.SymInt):
            return self.int_of(fake)
        return arg

    def _copy(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        mapping: dict = {}
        graph.output(graph.graph_copy(gm.graph, mapping))
        made: dict[int, object] = {}

        def ours(value: object) -> object:
            if isinstance(value, torch.Tensor) and value.layout is torch.strided and is_symbolic(value):
                if id(value) not in made:
                    made[id(value)] = self._fake_of(value)
                return made[id(value)]
            if isinstance(value, SYMBOLIC_TYPES):
                return self.int_of(value)
            return value

        for old, new in mapping.items():
            if "example_value" in old.meta:
                new.meta["example_value"] = pytree.tree_map(ours, old.meta["example_value"])
        return torch.fx.GraphModule(gm, graph)

    def guard(self) -> "WeldGuard":
        """What the compile assumed about the symbols, as a check over their values."""
        return WeldGuard(self.env, list(self.symbols))


class WeldGuard:
    """The guards weld's ShapeEnv recorded, as one Python function of the symbols' values."""

    def __init__(self, env: ShapeEnv, symbols: list):
        self.symbols = symbols
        pinned = [s for s in symbols if env.replace(s).is_number]
        if pinned:
            raise SymbolicCompileError(f"the compile made {', '.join(map(str, pinned))} a number")
        names = {s: sympy.Symbol(f"_v{k}", integer=True) for k, s in enumerate(symbols)}
        terms = []
        for g in env.guards:
            expr = env.simplify(g.expr)
            if isinstance(expr, sympy.Eq) and any(side.is_Float for side in expr.args):
                # a float of the sizes fixed (`float(n) == 3.0`): the compile holds at one size, as one per size
                raise SymbolicCompileError(f"the compile fixed a value of the sizes: {expr}")
            if expr != sympy.true:
                terms.append(python_text(expr, names, lambda m: m.__name__))
        for s in symbols:  # the replacements weld's compile learned (a symbol equal to another)
            replaced = env.replace(s)
            if replaced != s:
                terms.append(python_text(sympy.Eq(s, replaced), names, lambda m: m.__name__))
        self.text = " and ".join(f"({t})" for t in terms) or "True"
        self.always = not terms  # nothing assumed: no check at a call
        params = ", ".join(str(n) for n in names.values())
        namespace = {"math": __import__("math"), "torch": torch}
        exec(f"def check({params}):\n    return bool({self.text})", namespace)  # noqa: S102 (our own text)
        self.check: Callable[..., bool] = namespace["check"]


class CompiledSymbolic:
    """Calls `compiled` (one compile for every size its guard admits), else `per_size`."""

    def __init__(self, compiled: Callable, guard: WeldGuard, reads: list[tuple[int, int | None]], per_size: Callable,
                 settings: list = ()):
        self.compiled = compiled
        self.guard = guard
        # the symbols' values in a call's arguments, in the guard's order: one generated function
        values = ", ".join(f"args[{i}]" if d is None else f"args[{i}].shape[{d}]" for i, d in reads)
        self._values: Callable[[tuple], tuple] = eval(f"lambda args: ({values}{',' if values else ''})")  # noqa: S307
        self.per_size = per_size
        self.settings = settings  # module_settings.leaf_settings: (module, getter) the kernels read
        self._compiled_for = read_settings(settings)
        self._told = False

    def __call__(self, *args):
        if (self.guard.always or self.guard.check(*self._values(args))) \
                and (not self.settings or read_settings(self.settings) == self._compiled_for):
            return self.compiled(*args)
        if not self._told:
            self._told = True
            logs.get("dynamic").info("weld's symbolic compile assumed %s; a call outside it is compiled per size",
                                     self.guard.text)
        return self.per_size(*args)
