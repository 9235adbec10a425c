"""Where a value came from outside the frame: `L['x']`, `G['torch'].nn`, `L['self'].fc.weight`.

A source has two spellings. `name()` is the readable one used in guards shown to
people and in placeholder names. `expr()` is Python source that evaluates to the
value inside a generated entry function, whose parameters are the frame's
arguments (so a local is its bare name) and whose globals hold `___G` (the
frame's globals), `___B` (builtins) and `___closure` (the frame's closure cells).
"""
from __future__ import annotations

import dataclasses
import re


def _kept(method):
    """A source's `name` or `expr`, computed once per source: a parameter's path from the
    frame's `self` (L['self'].features.denseblock1.denselayer1.conv1.weight) is spelled again
    for each guard and placeholder that names it. Sources are frozen, so it cannot change."""
    slot = f"_kept_{method.__name__}"

    def kept(self) -> str:
        text = self.__dict__.get(slot)
        if text is None:
            text = method(self)
            object.__setattr__(self, slot, text)
        return text

    kept.__name__, kept.__doc__ = method.__name__, method.__doc__
    return kept


class Source:
    def name(self) -> str:
        raise NotImplementedError

    def expr(self) -> str:
        raise NotImplementedError

    def reads(self) -> tuple["Source", ...]:
        """The sources whose values this one's expression reads first (a base, a key)."""
        return ()

    def expr_from(self, inner: list[str]) -> str:
        """This source's expression over expressions of `reads()` (variables holding them)."""
        return self.expr()

    def placeholder_name(self) -> str:
        """`L['self'].fc.weight` -> `l_self_fc_weight_`, the torch.compile spelling."""
        text = re.sub(r"[^0-9a-zA-Z_]+", "_", self.name()).strip("_").lower()
        return f"{text}_"

    def __str__(self) -> str:
        return self.name()


@dataclasses.dataclass(frozen=True)
class LocalSource(Source):
    local: str

    def name(self) -> str:
        return f"L[{self.local!r}]"

    def expr(self) -> str:
        return self.local


@dataclasses.dataclass(frozen=True)
class GlobalSource(Source):
    global_name: str

    def name(self) -> str:
        return f"G[{self.global_name!r}]"

    def expr(self) -> str:
        return f"___G[{self.global_name!r}]"


@dataclasses.dataclass(frozen=True)
class GlobalsSource(Source):
    """The globals dict itself: of the compiled frame (module None) or of another module."""

    module: str | None = None

    def name(self) -> str:
        return "G" if self.module is None else f"G[{self.module!r}]"

    def expr(self) -> str:
        return "___G" if self.module is None else f"___modules[{self.module!r}].__dict__"


@dataclasses.dataclass(frozen=True)
class EnvironSource(Source):
    """`os.environ.get(key)`: the variable's value, or None where it is not set."""

    key: str

    def name(self) -> str:
        return f"os.environ.get({self.key!r})"

    def expr(self) -> str:
        return f"___modules['os'].environ.get({self.key!r})"


@dataclasses.dataclass(frozen=True)
class ConstantSource(Source):
    """An object capture holds itself (a class that a type guard pins, a module it imported),
    named `constant` in the entry's namespace: reads of its attributes go through it, and
    are guarded as any value read from outside."""

    constant: str  # its name in the entry's namespace (GuardSet.name_constant)
    readable: str  # "<class Config at 0x7f..>"

    def name(self) -> str:
        return self.readable

    def expr(self) -> str:
        return self.constant


@dataclasses.dataclass(frozen=True)
class CallResultSource(Source):
    """`function(*args, **kwargs)` with constant arguments, asked anew at each call: the answer
    of an lru_cache function or a query of torch's settings (`torch.get_float32_matmul_precision()`),
    guarded like any value read from outside the frame."""

    function: Source
    arguments: str  # the name, in the entry's namespace, of the (args, kwargs) pair
    readable: str  # the arguments as the user wrote them: "2, key='a'"

    def name(self) -> str:
        return f"{self.function.name()}({self.readable})"

    def expr(self) -> str:
        return self.expr_from([self.function.expr()])

    def reads(self) -> tuple[Source, ...]:
        return (self.function,)

    def expr_from(self, inner: list[str]) -> str:
        return f"{inner[0]}(*{self.arguments}[0], **{self.arguments}[1])"


@dataclasses.dataclass(frozen=True)
class ModuleGlobalSource(Source):
    """A global of another module (read by a function inlined from that module)."""

    module: str
    global_name: str

    def name(self) -> str:
        return f"G[{self.module!r}][{self.global_name!r}]"

    def expr(self) -> str:
        return f"___modules[{self.module!r}].__dict__[{self.global_name!r}]"


@dataclasses.dataclass(frozen=True)
class BuiltinSource(Source):
    builtin: str

    def name(self) -> str:
        return f"B[{self.builtin!r}]"

    def expr(self) -> str:
        return f"___B[{self.builtin!r}]"


@dataclasses.dataclass(frozen=True)
class ClosureSource(Source):
    """The contents of cell `index` of a function's closure."""

    function: Source | None  # None: the compiled frame's own closure
    index: int
    var: str

    def name(self) -> str:
        if self.function is None:
            return f"C[{self.var!r}]"
        return f"{self.function.name()}.__closure__[{self.index}].cell_contents"

    def expr(self) -> str:
        base = "___closure" if self.function is None else f"{self.function.expr()}.__closure__"
        return f"{base}[{self.index}].cell_contents"


@dataclasses.dataclass(frozen=True)
class AttrSource(Source):
    base: Source
    attr: str

    @_kept
    def name(self) -> str:
        return f"{self.base.name()}.{self.attr}"

    @_kept
    def expr(self) -> str:
        return self.on(self.base.expr())

    def reads(self) -> tuple[Source, ...]:
        return (self.base,)

    def expr_from(self, inner: list[str]) -> str:
        return self.on(inner[0])

    def on(self, base: str) -> str:
        """This attribute of `base`, an expression for the base's value."""
        if self.attr.isidentifier() and not self.attr.startswith("__"):
            return f"{base}.{self.attr}"
        return f"getattr({base}, {self.attr!r})"


@dataclasses.dataclass(frozen=True)
class ModuleEntrySource(AttrSource):
    """`module.name` where `name` is registered in one of the module's own dicts
    (`_parameters`, `_buffers`, `_modules`). It reads like an attribute, and the
    entry function reads it from that dict, as `nn.Module.__getattr__` does, without
    a Python-level call per step of every guarded module path."""

    store: str = "_modules"

    def on(self, base: str) -> str:
        return f"{base}.{self.store}[{self.attr!r}]"


@dataclasses.dataclass(frozen=True)
class ItemSource(Source):
    """`base[key]` for a constant key (tuple/list index or dict key)."""

    base: Source
    key: object

    @_kept
    def name(self) -> str:
        return f"{self.base.name()}[{self.key!r}]"

    @_kept
    def expr(self) -> str:
        return self.on(self.base.expr())

    def reads(self) -> tuple[Source, ...]:
        return (self.base,)

    def expr_from(self, inner: list[str]) -> str:
        return self.on(inner[0])

    def on(self, base: str) -> str:
        return f"{base}[{self.key!r}]"


@dataclasses.dataclass(frozen=True)
class DefaultSource(Source):
    """A default argument value of a function, read from the function object."""

    function: Source
    index: int | str  # position in __defaults__, or keyword in __kwdefaults__

    def name(self) -> str:
        field = "__kwdefaults__" if isinstance(self.index, str) else "__defaults__"
        return f"{self.function.name()}.{field}[{self.index!r}]"

    def expr(self) -> str:
        field = "__kwdefaults__" if isinstance(self.index, str) else "__defaults__"
        return f"{self.function.expr()}.{field}[{self.index!r}]"


@dataclasses.dataclass(frozen=True)
class BuiltinMethodCallSource(Source):
    """`dict.get(base, 'key')`: a read-only method of a builtin base class, called on an
    object of a subclass (what `super().get('key')` does)."""

    builtin_type: str
    method: str
    base: Source
    args: tuple

    def name(self) -> str:
        rest = "".join(f", {a!r}" for a in self.args)
        return f"{self.builtin_type}.{self.method}({self.base.name()}{rest})"

    def expr(self) -> str:
        rest = "".join(f", {a!r}" for a in self.args)
        return f"___B[{self.builtin_type!r}].{self.method}({self.base.expr()}{rest})"


@dataclasses.dataclass(frozen=True)
class ObjectKeySource(Source):
    """`base[key]` where the key is itself an object read from a source: an optimizer's
    `state[param]`, keyed by the parameter tensor."""

    base: Source
    key: Source

    def name(self) -> str:
        return f"{self.base.name()}[{self.key.name()}]"

    def expr(self) -> str:
        return self.expr_from([self.base.expr(), self.key.expr()])

    def reads(self) -> tuple[Source, ...]:
        return (self.base, self.key)

    def expr_from(self, inner: list[str]) -> str:
        return f"{inner[0]}[{inner[1]}]"


@dataclasses.dataclass(frozen=True)
class NumberTensorSource(Source):
    """A Python number read from `base`, handed to the graph as a 0-d tensor of (a
    function of) it: the entry calls `holder` (a `number_inputs.NumberTensor` that the
    entry's namespace names), which refills its one tensor when the number changed."""

    base: Source
    holder: str  # the holder's name in the entry's namespace
    formula: str  # what it holds, readable: `1 - L['opt'].param_groups[0]['lr'] * 0.01`
    device: str
    dtype: object  # torch.dtype

    def name(self) -> str:
        return f"tensor({self.formula}, dtype={self.dtype}, device={self.device!r})"

    def expr(self) -> str:
        return self.expr_from([self.base.expr()])

    def reads(self) -> tuple[Source, ...]:
        return (self.base,)

    def expr_from(self, inner: list[str]) -> str:
        return f"{self.holder}({inner[0]})"


def shared_reads(sources: list[Source]) -> tuple[list[str], list[str]]:
    """The expressions of `sources`, each read that two or more of them share
    (`opt.param_groups[0]['params']`, `opt.state[p]`) made once into a variable
    `___sN`: (the assignments, in order; one expression per source)."""
    counts: dict[str, int] = {}
    for source in sources:
        for part in _parts(source):
            counts[part.name()] = counts.get(part.name(), 0) + 1
    lines: list[str] = []
    variables: dict[str, str] = {}

    def expr(source: Source) -> str:
        key = source.name()
        if key in variables:
            return variables[key]
        text = source.expr_from([expr(s) for s in source.reads()])
        if counts.get(key, 0) < 2 or isinstance(source, LocalSource):
            return text
        variables[key] = f"___s{len(variables)}"
        lines.append(f"{variables[key]} = {text}")
        return variables[key]

    return lines, [expr(s) for s in sources]


def _parts(source: Source) -> set[Source]:
    """`source` and every source its expression reads first."""
    return {source}.union(*(_parts(s) for s in source.reads()))
