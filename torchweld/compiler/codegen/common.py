"""The render loop every kernel target shares: stages, scopes, CSE'd expressions.

A target is a short subclass (`CppRenderer`, `TritonRenderer`) that fills two
tables, `dtype_names` and `code_for_op`, and the few hooks that differ: how
loops open and close, how a load, a store and an accumulation read.
"""
from __future__ import annotations

from typing import Callable

import torch

from torchweld.compiler import ir
from torchweld.compiler.ir import Expr, Op
from torchweld.compiler.schedule import Kernel, Stage


# The operators every C-like target spells alike; a renderer's `code_for_op` starts from these.
C_LIKE_OPS: dict[Op, Callable[..., str]] = {
    Op.IMOD: lambda a, b: f"{a} % {b}",
    Op.NEG: lambda a: f"-{a}",
    Op.RECIPROCAL: lambda a: f"1 / {a}",
    Op.BITWISE_NOT: lambda a: f"~{a}",
    Op.ADD: lambda a, b: f"{a} + {b}",
    Op.SUB: lambda a, b: f"{a} - {b}",
    Op.MUL: lambda a, b: f"{a} * {b}",
    Op.TRUEDIV: lambda a, b: f"{a} / {b}",
    Op.LT: lambda a, b: f"{a} < {b}",
    Op.LE: lambda a, b: f"{a} <= {b}",
    Op.GT: lambda a, b: f"{a} > {b}",
    Op.GE: lambda a, b: f"{a} >= {b}",
    Op.EQ: lambda a, b: f"{a} == {b}",
    Op.NE: lambda a, b: f"{a} != {b}",
    Op.BITWISE_AND: lambda a, b: f"{a} & {b}",
    Op.BITWISE_OR: lambda a, b: f"{a} | {b}",
    Op.BITWISE_XOR: lambda a, b: f"{a} ^ {b}",
}


class Scope:
    """Generated lines at one nesting level, with the CSE cache valid there."""

    def __init__(self, parent: "Scope | None", indent: int):
        self.parent, self.indent = parent, indent
        self.cache: dict[tuple, str] = {}

    def forget_loads(self, buffer: str) -> None:
        """Drop the loads of `buffer` cached here and in the enclosing scopes: it was just
        stored to, and a later load must read memory again."""
        scope = self
        while scope is not None:
            for key in [k for k in scope.cache if k[0] in (Op.LOAD, Op.MASKED_LOAD) and k[2] == buffer]:
                del scope.cache[key]
            scope = scope.parent

    def lookup(self, key: tuple) -> str | None:
        scope = self
        while scope is not None:
            if key in scope.cache:
                return scope.cache[key]
            scope = scope.parent
        return None


class KernelRenderer:
    """Render one scheduled `Kernel` as source text for a target."""

    name: str = "KernelRenderer"
    dtype_names: dict[torch.dtype, str] = {}
    code_for_op: dict[Op, Callable[..., str]] = {}
    unsupported_dtypes: frozenset = frozenset()
    reduce_ops: frozenset = frozenset()

    # -- checks the lowering runs before it commits to a body ----------------
    @classmethod
    def check(cls, e: Expr) -> None:
        """Raise NotImplementedError if some node of `e` has no rule here."""
        for node in ir.walk(e):
            if node.op in ir.OpSet.Leaf or node.op is Op.CAST:
                pass
            elif node.op not in cls.code_for_op:
                raise NotImplementedError(f"{cls.name} has no rule for {node.op}")
            if node.dtype not in cls.dtype_names or node.dtype in cls.unsupported_dtypes:
                raise NotImplementedError(f"{cls.name} has no dtype {node.dtype}")
            cls.check_node(node)

    @classmethod
    def check_node(cls, node: Expr) -> None:
        pass

    @classmethod
    def check_reduction(cls, reduce_op: Op, dtype: torch.dtype) -> None:
        if reduce_op not in cls.reduce_ops:
            raise NotImplementedError(f"{cls.name} has no rule for {reduce_op}")
        if dtype not in cls.dtype_names or dtype in cls.unsupported_dtypes:
            raise NotImplementedError(f"{cls.name} has no dtype {dtype}")

    # -- the shared loop --------------------------------------------------------
    def render(self, kernel: Kernel) -> str:
        self.kernel = kernel
        self.lines: list[str] = []
        self.tmp_count = 0
        self.reduced_names: dict[str, str] = {}
        self.args = kernel.args
        self.hoisting: list | None = None
        scope = self.open_kernel(kernel)
        for i, stage in enumerate(kernel.stages):
            mark = len(self.lines)
            inner = self.open_stage(i, stage, scope)
            self.hoisting = [scope, mark]  # (see `expr`)
            for acc in stage.reductions:
                self.accumulate(acc, self.expr(acc.value, inner), inner)
            for store in stage.stores:
                self.store(store, inner)
            self.hoisting = None
            self.close_stage(i, stage, scope)
        self.render_outer_stores(kernel, scope)
        self.close_kernel(kernel)
        return "\n".join(self.lines) + "\n"

    def render_outer_stores(self, kernel: Kernel, scope: Scope) -> None:
        for store in kernel.outer_stores:
            self.store(store, scope)

    def emit(self, scope: Scope, line: str) -> None:
        if self.hoisting is not None and scope is self.hoisting[0]:  # before the stage's loops
            self.lines.insert(self.hoisting[1], "    " * scope.indent + line)
            self.hoisting[1] += 1
            return
        self.lines.append("    " * scope.indent + line)

    def new_tmp(self, prefix: str = "tmp") -> str:
        self.tmp_count += 1
        return f"{prefix}{self.tmp_count}"

    def pointer(self, buffer: str) -> str:
        return f"ptr{self.args.index(buffer)}"

    def expr(self, e: Expr, scope: Scope) -> str:
        """The name (or inline text) of `e`'s value in `scope`, emitting what it needs. Inside a
        reduction stage, what does not vary along its loops (a row's mean, the element a
        variance is taken about) is computed once before them, in the stage's outer scope."""
        names: dict[int, str] = {}
        outer = self.hoisting[0] if self.hoisting is not None else None
        fixed: dict[int, bool] = {}  # node -> whether it is one value along the stage's loops
        for node in ir.walk(e):
            args = [names[id(a)] for a in node.args]
            if node.op is Op.VAR:
                fixed[id(node)] = not self.varies_in_stage(node.arg)
            elif node.op is Op.REDUCED:
                fixed[id(node)] = self.reduced_fixed_in_stage
            else:
                fixed[id(node)] = all(fixed[id(a)] for a in node.args)
            hoist = outer is not None and fixed[id(node)] and node.op is not Op.CONST and node.op is not Op.VAR
            names[id(node)] = self.node_code(node, args, outer if hoist else scope)
        return names[id(e)]

    def varies_in_stage(self, variable: str) -> bool:
        """Whether index variable `variable` is one a reduction stage's loops define."""
        return variable.startswith("r")

    # whether an earlier stage's result is one value along a stage's loops (not: a C++ outer
    # reduction's, an array over the lanes of its simd loop)
    reduced_fixed_in_stage = True

    def node_code(self, node: Expr, args: list[str], scope: Scope) -> str:
        if node.op is Op.CONST:
            if ir.is_symbolic_const(node):  # (size_args takes those of index arithmetic as arguments)
                raise NotImplementedError(f"{self.name}: a symbolic size {node.arg} as a {node.dtype} value")
            return self.render_const(node.arg, node.dtype)
        if node.op is Op.VAR:
            return str(node.arg)
        if node.op is Op.REDUCED:
            return self.reduced_names[node.arg]
        key = (node.op, node.dtype, node.arg, tuple(args))
        hit = scope.lookup(key)
        if hit is not None:
            return hit
        if node.op is Op.LOAD:
            code = self.render_load(node.arg, args[0], node.dtype, scope, node.args[0])
        elif node.op is Op.MASKED_LOAD:
            code = self.render_load(node.arg, args[0], node.dtype, scope, node.args[0], mask=args[1])
        elif node.op is Op.CAST:
            code = self.render_cast(args[0], node.args[0].dtype, node.dtype)
        else:
            rule = self.code_for_op.get(node.op)
            if rule is None:
                raise NotImplementedError(f"{self.name} has no rule for {node.op}")
            code = rule(*args)
        if node.dtype is ir.INDEX and node.op is not Op.LOAD and node.op is not Op.MASKED_LOAD:
            code = f"({code})"  # index arithmetic stays inline: the compiler sees affine indexing
        else:
            name = self.new_tmp()
            self.emit(scope, self.assign(name, code, node.dtype))
            code = name
        scope.cache[key] = code
        return code

    # -- hooks a target fills -------------------------------------------------------
    def open_kernel(self, kernel: Kernel) -> Scope:
        raise NotImplementedError

    def close_kernel(self, kernel: Kernel) -> None:
        raise NotImplementedError

    def open_stage(self, i: int, stage: Stage, outer: Scope) -> Scope:
        raise NotImplementedError

    def close_stage(self, i: int, stage: Stage, outer: Scope) -> None:
        raise NotImplementedError

    def accumulate(self, acc, value: str, scope: Scope) -> None:
        raise NotImplementedError

    def store(self, store, scope: Scope) -> None:
        raise NotImplementedError

    def render_load(self, buffer: str, index: str, dtype: torch.dtype, scope: Scope, index_expr: Expr) -> str:
        """The code of a load of `buffer` at `index`, the rendered `index_expr`."""
        raise NotImplementedError

    def render_cast(self, x: str, src: torch.dtype, dst: torch.dtype) -> str:
        raise NotImplementedError

    def render_const(self, value: object, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def assign(self, name: str, code: str, dtype: torch.dtype) -> str:
        raise NotImplementedError
