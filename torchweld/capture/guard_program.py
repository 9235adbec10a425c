"""Lay out a GuardSet as the tables the C guard evaluator (guard_eval.c) runs.

Nodes: one per value the guards read from the frame (an argument, the frame's
globals, `L['self'].h[4].attn`, ...), each reading from its parent node, so that a
value several guards test is read once per call; a node is keyed by its source's
name, as `GuardSet.expression()` keys its walrus variables. Checks: one per guard, in
the guards' order, each testing one node's value the way the guard's Python
expression does. One table of rules per Source class and one per guard kind; a
source or guard they cannot express becomes a small compiled Python function over
the frame's arguments that the evaluator calls, so an odd guard costs only itself.

The guard on symbolic sizes (guards.py's `sizes`) becomes a "sizes" check (SizeLayout):
the sizes, strides and int arguments it reads, each into an int64 slot, and each relation
a postfix program over them, compiled from the relation's own Python text, so that both
evaluators compute the same thing; a relation with anything else in it (a float, a
function of torch or math) is a Python function of the slots it names, and only it.
"""
from __future__ import annotations

import ast
import functools
import types
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

from torchweld import config, logs
from torchweld.capture import guard_extension
from torchweld.capture.guards import Guard, GuardSet
from torchweld.capture.sources import (
    AttrSource, BuiltinMethodCallSource, BuiltinSource, ClosureSource, ConstantSource, DefaultSource, GlobalSource,
    GlobalsSource,
    ItemSource, LocalSource, ModuleEntrySource, ModuleGlobalSource, ObjectKeySource, Source,
)

EVALUATORS = ("c", "python")  # the values config.guard_evaluator may take


def compile_guards(guards: GuardSet, params: list[str], namespace: dict) -> Callable | None:
    """The C evaluator of `guards`: called with the frame's parameters `params` in order,
    True when every guard holds. None where config.guard_evaluator is "python" or the
    extension cannot be built; the caller then runs `guards.expression()`.
    `namespace` is the entry function's: sources' roots (`___G`, ...) and guard constants."""
    if config.guard_evaluator not in EVALUATORS:
        raise ValueError(f"torchweld.config.guard_evaluator is {config.guard_evaluator!r}; "
                         f"it takes one of {', '.join(map(repr, EVALUATORS))}")
    extension = guard_extension.load() if config.guard_evaluator == "c" else None
    if extension is None:
        return None
    program = lay_out(guards, params, namespace)
    return extension.Evaluator(len(params), program.nodes, program.checks, mirrored_module_getattr())


def lay_out(guards: GuardSet, params: list[str], namespace: dict) -> GuardProgram:
    """The tables of `guards` (see compile_guards), which tests read too."""
    program = GuardProgram(params, namespace)
    for guard in guards.guards:
        program.add_guard(guard)
    if guards.hook_guards:  # skipped while no hook handle was made since they last held
        program.checks.append(("fence", -1, -1, (RemovableHandle, guards.hook_fence.seen, len(guards.hook_guards))))
        for guard in guards.hook_guards:
            program.add_guard(guard)
    return program


@functools.lru_cache(maxsize=None)
def mirrored_module_getattr() -> Callable | None:
    """torch.nn.Module.__getattr__ where it still reads what guard_eval.c's
    module_store_lookup mirrors (`self.__dict__`'s `_parameters`, `_buffers`, `_modules`,
    in that order, else AttributeError); None otherwise, and the evaluator then calls it."""
    fn = torch.nn.Module.__getattr__
    code = fn.__code__
    stores = [c for c in code.co_consts if isinstance(c, str) and c.startswith("_")]
    if code.co_names[:2] == ("__dict__", "AttributeError") and stores == ["_parameters", "_buffers", "_modules"]:
        return fn
    logs.get("guards").info("torch.nn.Module.__getattr__ reads something new: guards call it instead of mirroring it")
    return None


class Unexpressible(Exception):
    """A source or guard the tables cannot spell: it runs as Python instead."""


class GuardProgram:
    """The node and check tables of one cache entry, in the tuple form guard_eval.c reads:
    a node is (kind, parent, second, payload), a check (kind, node, second, operands)."""

    def __init__(self, params: list[str], namespace: dict):
        self.params = params
        self.namespace = namespace
        self.nodes: list[tuple] = []
        self.checks: list[tuple] = []
        self._node_of_spec: dict[tuple, int] = {}
        self._node_of_source: dict[str, int] = {}

    def add_node(self, kind: str, payload: object, parent: int = -1, second: int = -1) -> int:
        """The index of the node reading `payload` of `parent` (made once per distinct read)."""
        key = (kind, parent, second, _payload_key(payload))
        if key not in self._node_of_spec:
            self._node_of_spec[key] = len(self.nodes)
            self.nodes.append((kind, parent, second, payload))
        return self._node_of_spec[key]

    def root(self, name: str) -> int:
        """A node for one of the entry namespace's roots: `___G`, `___B`, `___closure`, `___modules`."""
        return self.add_node("const", self.namespace[name])

    def source(self, source: Source) -> int:
        """The node whose value is `source`'s."""
        name = source.name()
        if name not in self._node_of_source:
            rule = SOURCE_RULES.get(type(source))
            try:
                if rule is None:
                    raise Unexpressible(type(source).__name__)
                index = rule(self, source)
            except Unexpressible:
                index = self.add_node("python", self.python_function(source.expr()))
            self._node_of_source[name] = index
        return self._node_of_source[name]

    def add_guard(self, guard: Guard) -> None:
        rule = CHECK_RULES.get(guard.kind)
        try:
            if rule is None:
                raise Unexpressible(guard.kind)
            check = rule(self, guard)
        except Unexpressible:
            check = ("python", -1, -1, (self.python_function(guard.expr),))
        self.checks.append(check)

    def python_function(self, expr: str) -> types.FunctionType:
        """`expr` as a function of the frame's parameters, over the entry's namespace."""
        text = f"def ___guard_part({', '.join(self.params)}):\n    return {expr}\n"
        exec(compile(text, "<torchweld guard>", "exec"), self.namespace)
        return self.namespace.pop("___guard_part")


def _payload_key(payload: object) -> object:
    """Equal for payloads that make the same read: literal names and keys by value, objects by identity."""
    if type(payload) is tuple:
        return tuple(_payload_key(p) for p in payload)
    if type(payload) in (str, int, bool, float, bytes, type(None)):
        return (type(payload), payload)
    return ("object", id(payload))


# -- sources: one rule per Source class --------------------------------------------
SourceRule = Callable[[GuardProgram, Source], int]
SOURCE_RULES: dict[type, SourceRule] = {}


def reads(cls: type) -> Callable[[SourceRule], SourceRule]:
    def register(rule: SourceRule) -> SourceRule:
        if cls in SOURCE_RULES:
            raise ValueError(f"two guard_program rules for {cls.__name__}")
        SOURCE_RULES[cls] = rule
        return rule
    return register


@reads(LocalSource)
def local(p: GuardProgram, s: LocalSource) -> int:
    if s.local not in p.params:
        raise Unexpressible(f"{s.local} is not a parameter")
    return p.add_node("arg", p.params.index(s.local))


@reads(GlobalSource)
def frame_global(p: GuardProgram, s: GlobalSource) -> int:
    return p.add_node("item", s.global_name, p.root("___G"))


@reads(ConstantSource)
def held_constant(p: GuardProgram, s: ConstantSource) -> int:
    return p.add_node("const", p.namespace[s.constant])


@reads(GlobalsSource)
def globals_dict(p: GuardProgram, s: GlobalsSource) -> int:
    if s.module is None:
        return p.root("___G")
    return p.add_node("attr", "__dict__", p.add_node("item", s.module, p.root("___modules")))


@reads(ModuleGlobalSource)
def module_global(p: GuardProgram, s: ModuleGlobalSource) -> int:
    module = p.add_node("item", s.module, p.root("___modules"))
    return p.add_node("item", s.global_name, p.add_node("attr", "__dict__", module))


@reads(BuiltinSource)
def builtin(p: GuardProgram, s: BuiltinSource) -> int:
    return p.add_node("item", s.builtin, p.root("___B"))


@reads(ClosureSource)
def closure_cell(p: GuardProgram, s: ClosureSource) -> int:
    cells = p.root("___closure") if s.function is None else p.add_node("attr", "__closure__", p.source(s.function))
    return p.add_node("attr", "cell_contents", p.add_node("item", s.index, cells))


@reads(AttrSource)
def attribute(p: GuardProgram, s: AttrSource) -> int:
    return p.add_node("attr", s.attr, p.source(s.base))


@reads(ModuleEntrySource)
def module_entry(p: GuardProgram, s: ModuleEntrySource) -> int:
    return p.add_node("module_entry", (s.store, s.attr), p.source(s.base))


@reads(ItemSource)
def item(p: GuardProgram, s: ItemSource) -> int:
    return p.add_node("item", s.key, p.source(s.base))


@reads(ObjectKeySource)
def object_key(p: GuardProgram, s: ObjectKeySource) -> int:
    getitem = p.add_node("attr", "__getitem__", p.source(s.base))
    return p.add_node("call", (), getitem, p.source(s.key))


@reads(DefaultSource)
def default_argument(p: GuardProgram, s: DefaultSource) -> int:
    field = "__kwdefaults__" if isinstance(s.index, str) else "__defaults__"
    return p.add_node("item", s.index, p.add_node("attr", field, p.source(s.function)))


@reads(BuiltinMethodCallSource)
def builtin_method_call(p: GuardProgram, s: BuiltinMethodCallSource) -> int:
    if len(s.args) > 7:
        raise Unexpressible("a builtin method call with more than 7 constant arguments")
    method = p.add_node("attr", s.method, p.add_node("item", s.builtin_type, p.root("___B")))
    return p.add_node("call", tuple(s.args), method, p.source(s.base))


# -- checks: one rule per guard kind (guards.py documents each kind's operands) -----
CheckRule = Callable[[GuardProgram, Guard], tuple]


def check_of_source(p: GuardProgram, g: Guard) -> tuple:
    """A test of the guard's source alone, against its operands as guards.py made them."""
    if g.source is None:
        raise Unexpressible(f"a {g.kind} guard without a source")
    return (g.kind, p.source(g.source), -1, g.operands)


def same_object(p: GuardProgram, g: Guard) -> tuple:
    (first,) = g.operands
    return ("same", p.source(g.source), p.source(first), ())


def has_attribute(p: GuardProgram, g: Guard) -> tuple:
    """Tests the node of `source.attr`, which a later guard on that attribute then reuses;
    a node already made for that name by another spelling (a module entry) is not a
    `getattr`, so the test gets its own."""
    attr, _ = g.operands
    node = p.source(AttrSource(g.source, attr))
    if p.nodes[node][0] != "attr":
        node = p.add_node("attr", attr, p.source(g.source))
    return ("hasattr", node, -1, g.operands)


def call_is(p: GuardProgram, g: Guard) -> tuple:
    return ("call_is", -1, -1, g.operands)


def symbolic_tensor(p: GuardProgram, g: Guard) -> tuple:
    """Reads the tensor's shape as a node of its own, which the sizes check reads again."""
    node = p.source(g.source)
    return ("symbolic_tensor", node, shape_of(p, node), g.operands)


def shape_of(p: GuardProgram, tensor: int) -> int:
    return p.add_node("attr", "shape", tensor)


CHECK_RULES: dict[str, CheckRule] = {
    **{kind: check_of_source for kind in ("id", "type", "is", "equals", "len", "dict_keys", "tensor", "instance_dict",
                                          "lacks", "held_tensor")},
    "same": same_object,
    "hasattr": has_attribute,
    "call_is": call_is,
    "symbolic_tensor": symbolic_tensor,
    "sizes": lambda p, g: SizeLayout(p).check(g),
}


# -- the sizes check: reads into slots, relations as int64 postfix programs ---------
INT64 = range(-2**63, 2**63)
BINARY_OPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.FloorDiv: "floordiv", ast.Mod: "mod",
              ast.Pow: "pow"}
COMPARISONS = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge"}
VALUE = "___value"  # in a size or stride relation's text: the size it compares


class SizeLayout:
    """One sizes guard (guards.py: symbolic_sizes.Bind and Relation operands) as guard_eval.c's
    sizes check: (reads, code, functions, the guard as Python for the calls that code cannot
    decide). A read is (node, "value" | "size" | "stride" | "dims", dim, the type the node's value
    must have, the node of its shape for "size" and "dims" or -1); the code requires each
    relation in the guard's order."""

    def __init__(self, p: GuardProgram):
        self.p = p
        self.functions: list[Callable] = []  # the relations left to Python
        self.slot: dict[tuple, int] = {}  # read -> its value's slot
        self.symbols: dict[str, int] = {}  # `___s0` -> the slot of the size bound to it

    def check(self, g: Guard) -> tuple:
        binds, relations = g.operands
        wanted = {self._size(b.source, b.dim) for b in binds}
        for r in relations:
            if r.kind == "size":
                wanted.add(self._size(r.source, r.dim))
            elif r.kind == "stride":
                wanted |= {self._read(r.source, "dims"), *(self._read(r.source, "stride", d) for d in range(len(r.terms)))}
        reads = sorted(wanted, key=lambda read: read[:3])  # a node's strides together: one stride() call
        self.slot = {read: k for k, read in enumerate(reads)}
        self.symbols = {f"___{b.symbol}": self.slot[self._size(b.source, b.dim)] for b in binds}
        code: list = []
        for r in relations:
            if r.kind == "size":  # `x.size(d) == term`, the read in place of `x.size(d)`
                code += self._equals(self._size(r.source, r.dim), r.terms[0], r.readable)
            elif r.kind == "stride":  # `x.stride() == (terms)`: as many strides, each equal to its term
                code += ["slot", self.slot[self._read(r.source, "dims")], "const", len(r.terms), "eq", "require"]
                for d, term in enumerate(r.terms):
                    code += self._equals(self._read(r.source, "stride", d), f"({term})", r.readable)
            else:
                code += self._relation(r.expr, r.readable, self.symbols)
        return ("sizes", -1, -1, (tuple(reads), tuple(code), tuple(self.functions), self.p.python_function(g.expr)))

    def _read(self, source: Source, what: str, dim: int = 0) -> tuple:
        node = self.p.source(source)
        shape = shape_of(self.p, node) if what in ("size", "dims") else -1
        return (node, what, dim, int if what == "value" else torch.Tensor, shape)

    def _size(self, source: Source, dim: int | None) -> tuple:
        """The read of `source.size(dim)`; dim None: of the int `source` itself."""
        return self._read(source, "value") if dim is None else self._read(source, "size", dim)

    def _equals(self, read: tuple, term: str, readable: str) -> list:
        return self._relation(f"{VALUE} == {term}", readable, {**self.symbols, VALUE: self.slot[read]})

    def _relation(self, text: str, readable: str, slots: dict[str, int]) -> list:
        """Code requiring that `text` (Python over the names in `slots`) holds: as int64 ops, or
        where it has more than those can compute, as a call of it compiled as Python."""
        tree = ast.parse(text, mode="eval").body
        try:
            return [*postfix(tree, slots, self.p.namespace), "require"]
        except Unexpressible as e:
            logs.get("guards").info("symbolic sizes: %s runs as Python (%s)", readable, e)
        names = [n for n in dict.fromkeys(node.id for node in ast.walk(tree) if isinstance(node, ast.Name)) if n in slots]
        source = f"def ___size_relation({', '.join(names)}):\n    return {text}\n"
        exec(compile(source, "<torchweld guard>", "exec"), self.p.namespace)
        self.functions.append(self.p.namespace.pop("___size_relation"))
        return [*(x for n in names for x in ("slot", slots[n])), "call", len(self.functions) - 1, len(names), "require"]


def postfix(node: ast.expr, slots: dict[str, int], namespace: dict) -> list:
    """The ops of guard_eval.c's size programs that compute `node` as Python computes it, where
    every name in it is an int in `slots`; Unexpressible where it holds anything else."""
    def ops(*args: ast.expr) -> list:
        return [op for arg in args for op in postfix(arg, slots, namespace)]

    def fold(name: str, args: list[ast.expr]) -> list:  # a op b op c ..., left to right
        return [*ops(args[0]), *(op for arg in args[1:] for op in (*ops(arg), name))]

    match node:
        case ast.Constant(value=int() as value) if value in INT64:  # (True and False too)
            return ["const", int(value)]
        case ast.Name(id=name) if name in slots:
            return ["slot", slots[name]]
        case ast.BinOp(left, op, right) if type(op) in BINARY_OPS:
            return [*ops(left, right), BINARY_OPS[type(op)]]
        case ast.UnaryOp(ast.USub(), operand):
            return [*ops(operand), "neg"]
        case ast.UnaryOp(ast.UAdd(), operand):
            return ops(operand)
        case ast.UnaryOp(ast.Not(), operand):
            return [*ops(operand), "not"]
        case ast.Compare(left, [op], [right]) if type(op) in COMPARISONS:
            return [*ops(left, right), COMPARISONS[type(op)]]
        case ast.BoolOp(op, values):
            return fold("and" if isinstance(op, ast.And) else "or", values)
        case ast.Call(ast.Name(id="max" | "min" as name), args, []) if len(args) > 1 and name not in namespace:
            return fold(name, args)
        case ast.Call(ast.Name(id="abs"), [arg], []) if "abs" not in namespace:
            return [*ops(arg), "abs"]
    raise Unexpressible(ast.unparse(node))
