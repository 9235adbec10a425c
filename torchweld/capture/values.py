"""What the symbolic interpreter's stack and locals hold: one small class per kind
of Python value. A kind overrides only what it supports; every default raises
`Unsupported`, which ends the capture of the frame with that reason.

Data values live here (constants, tensors, containers, iterators, cells);
callables are in `callables.py` and objects (modules, instances) in `objects.py`.
"""
from __future__ import annotations

import dataclasses
import enum
import inspect
import operator
import types
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from torchweld.capture.sources import Source
from torchweld.capture.symbolic_sizes import SYMBOLIC_TYPES
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.guards import GuardSet
    from torchweld.capture.translator import Translator


class Value:
    source: Source | None = None

    def python_type(self) -> type:
        raise Unsupported(f"the type of {self} is not known at capture time")

    def as_constant(self) -> object:
        raise Unsupported(f"{self} is not a constant")

    def is_constant(self) -> bool:
        try:
            self.as_constant()
            return True
        except Unsupported:
            return False

    def truth(self, tx: "Translator") -> bool:
        try:
            return bool(self.as_constant())
        except Unsupported:
            pass
        try:
            kind = f"a {self.python_type().__qualname__} object"
        except Unsupported:
            kind = str(self)
        raise Unsupported(f"the truth of {kind} (`if obj:`, `not obj`) is not known at capture time")

    def items(self, tx: "Translator") -> list["Value"]:
        """The values iterating over this yields (all known at capture time)."""
        raise Unsupported(f"cannot iterate over {self} at capture time")

    def getattr(self, tx: "Translator", name: str) -> "Value":
        raise Unsupported(f"cannot read attribute {name!r} of {self}")

    def setattr(self, tx: "Translator", name: str, value: "Value") -> None:
        raise Unsupported(f"setting attribute {name!r} of {self} is a side effect capture does not model yet")

    def call(self, tx: "Translator", args: list["Value"], kwargs: dict[str, "Value"]) -> "Value":
        raise Unsupported(f"calling {self} is not supported")

    def real_object(self) -> object | None:
        """The Python object this value stands for, where capture holds it (modules,
        user objects, classes, functions); None for values that exist only symbolically."""
        return None

    def node_arg(self) -> object:
        """This value as an argument of an FX node."""
        value = self.as_constant()
        if not is_constant_literal(value):
            raise Unsupported(f"passing {self} to a graph operation is not supported")
        return value

    def example(self) -> object:
        """This value as an argument of the fake-tensor run that computes example values."""
        return self.as_constant()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source or ''})"


class ContextManagerValue(Value):
    """A context manager capture models (grad mode, autocast): `with` calls `enter` and
    leaves `exit_value()` on the stack, which the block's end calls."""

    def enter(self, tx: "Translator") -> Value:
        raise NotImplementedError

    def exit_value(self) -> Value:
        raise NotImplementedError


# ---------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------


class ConstantValue(Value):
    """A Python value known at capture time: numbers, strings, None, dtypes,
    devices, slices, ranges, torch.Size and tuples of such."""

    def __init__(self, value: object, source: Source | None = None):
        if isinstance(value, SYMBOLIC_TYPES):  # never a symbol as a constant:
            value = guard_scalar(value)  # its value now, which the ShapeEnv guards
        self.value = value
        self.source = source

    def python_type(self) -> type:
        return type(self.value)

    def as_constant(self) -> object:
        return self.value

    def items(self, tx: "Translator") -> list[Value]:
        try:
            return [const(v) for v in self.value]
        except TypeError:
            raise Unsupported(f"{type(self.value).__name__} is not iterable") from None

    def getattr(self, tx: "Translator", name: str) -> Value:
        attr = getattr(self.value, name)
        if callable(attr):
            from torchweld.capture.callables import ConstantMethodValue

            return ConstantMethodValue(self.value, name)
        if isinstance(attr, _FROZEN_TYPES):
            return ConstantValue(attr)
        return const(attr)

    def __repr__(self) -> str:
        return f"ConstantValue({self.value!r})"


class GuardedOnUseNumber(ConstantValue):
    """A float read from outside the frame, guarded on its type only until capture uses
    its value: then on its value, as any constant. The optimizer capture reads it as a
    graph input instead (an optimizer's learning rate and betas: see number_inputs.py)."""

    def __init__(self, value: float, source: Source, guards: "GuardSet"):
        super().__init__(value, source)
        self._guards = guards
        guards.type_is(source, type(value))

    def as_constant(self) -> object:
        self._guards.constant(self.source, self.value)
        return self.value

    def getattr(self, tx: "Translator", name: str) -> Value:
        self.as_constant()
        return super().getattr(tx, name)

    def guard_nonzero(self) -> None:
        """Guarded on being nonzero, its value not (a number Python divides by)."""
        self._guards.comparison(self.source, "!=", 0, True)

    def __repr__(self) -> str:
        return f"GuardedOnUseNumber({self.value!r}, {self.source})"


class DerivedNumber(ConstantValue):
    """A float Python computes from one read as a graph input and constants (`2 * lr`,
    `1 - decay`): `compute` does that arithmetic again from the input's value (`formula`
    spells it over the input's name). Where a tensor operation takes it (number_operands.py) the
    graph reads it as the input's holder computes it at each call, on the host in double
    precision as Python does; anywhere else it is a constant, and the input's value is guarded
    (as_constant). It has no source of its own: nothing reads it back from the frame."""

    def __init__(self, value: float, base: GuardedOnUseNumber, compute: Callable[[float], float], formula: str):
        super().__init__(value)
        self.base, self.compute, self.formula = base, compute, formula

    def as_constant(self) -> object:
        self.base.as_constant()
        return self.value

    def getattr(self, tx: "Translator", name: str) -> Value:
        self.as_constant()
        return super().getattr(tx, name)

    def __repr__(self) -> str:
        return f"DerivedNumber({self.value!r}, {self.formula.format(self.base.source.name())})"


_CONSTANT_TYPES = (
    type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type(NotImplemented),
    torch.dtype, torch.device, torch.layout, torch.memory_format, range, slice, torch.Size,
    torch.finfo, torch.iinfo,  # `torch.finfo(dtype).min` in attention masks
)


# immutable objects that capture-time evaluation may hand around (never graph arguments)
_FROZEN_TYPES = (types.MappingProxyType, types.CodeType, inspect.Signature, inspect.Parameter,
                 dataclasses.Field, type(dataclasses.MISSING))


def is_constant_literal(obj: object) -> bool:
    if type(obj) in (tuple, frozenset):
        return all(is_constant_literal(o) for o in obj)
    return type(obj) in _CONSTANT_TYPES or isinstance(obj, enum.Enum)  # enum members are immutable singletons


def const(value: object) -> Value:
    """A Value for a Python object made at capture time (no source, no guard)."""
    if isinstance(value, Value):
        return value
    if type(value) is list:
        return ListValue([const(v) for v in value])
    if type(value) is tuple and not is_constant_literal(value):
        return TupleValue([const(v) for v in value])
    if type(value) is dict:
        return DictValue({k: const(v) for k, v in value.items()})
    if isinstance(value, SYMBOLIC_TYPES):  # a size no graph value holds:
        return ConstantValue(guard_scalar(value))  # its value now, which the ShapeEnv guards
    if type(value) is torch.Size and any(isinstance(n, torch.SymInt) for n in value):
        return ConstantValue(torch.Size(int(n) for n in value))
    if is_constant_literal(value):
        return ConstantValue(value)
    raise Unsupported(f"capture cannot hold a {type(value).__name__} made at capture time")


class NullValue(Value):
    """The NULL that CPython pushes below a callable (PUSH_NULL, LOAD_GLOBAL with NULL)."""

    def __repr__(self) -> str:
        return "NULL"


NULL = NullValue()


# ---------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------


class TensorValue(Value):
    """A tensor in the graph: its FX node and a fake tensor with its metadata."""

    def __init__(self, node: torch.fx.Node, fake: torch.Tensor, source: Source | None = None, cls: type = torch.Tensor):
        self.node = node
        self.fake = fake
        self.source = source
        self.cls = cls  # the real tensor's class: torch.Tensor, nn.Parameter, a subclass

    def python_type(self) -> type:
        return self.cls

    def truth(self, tx: "Translator") -> bool:
        raise Unsupported("data-dependent control flow: the truth of a tensor is only known at run time")

    def node_arg(self) -> object:
        return self.node

    def example(self) -> object:
        return self.fake

    def items(self, tx: "Translator") -> list[Value]:
        if self.fake.dim() == 0:
            raise Unsupported("iteration over a 0-d tensor")
        return [tx.output.call_function(operator.getitem, [self, ConstantValue(i)], {}) for i in range(self.fake.shape[0])]

    def getattr(self, tx: "Translator", name: str) -> Value:
        from torchweld.capture.callables import TensorMethodValue

        fake = self.fake
        if name == "shape":
            return tx.output.size_of(self)
        if name in ("dtype", "device", "ndim", "is_cuda", "is_sparse", "is_quantized", "layout",
                    "requires_grad", "is_leaf", "itemsize", "nbytes"):
            if name in ("is_leaf",):
                raise Unsupported(f"tensor.{name} depends on autograd state capture does not track")
            return const(getattr(fake, name))
        if name in ("T", "mT", "H", "mH", "real", "imag"):
            return tx.output.call_function(getattr, [self, ConstantValue(name)], {})
        if name in ("grad", "data", "grad_fn", "_base", "_version"):
            raise Unsupported(f"reading tensor.{name} inside a compiled function is not supported yet")
        if callable(getattr(torch.Tensor, name, None)):
            return TensorMethodValue(self, name)
        raise Unsupported(f"unknown tensor attribute {name!r}")

    def __repr__(self) -> str:
        return f"TensorValue({self.node.name}, {tuple(self.fake.shape)}, {self.fake.dtype})"


class SymNumberValue(Value):
    """A number computed from symbolic sizes (`x.shape[0]`, `x.size(-1) // 2`, `x.numel()`): a graph
    node whose example is a torch.SymInt (or SymFloat). Where Python needs its exact value (a
    loop count, a container index, a call capture does not model) it is specialized: the
    ShapeEnv records `s0 == 8` and the entry's size guard checks it."""

    def __init__(self, node: torch.fx.Node, sym: object, output: object):
        self.node = node
        self.sym = sym
        self.output = output  # the OutputGraph whose ShapeEnv made it: spells it over the inputs' sizes

    def python_type(self) -> type:
        return int if isinstance(self.sym, torch.SymInt) else float

    def as_constant(self) -> object:
        return int(self.sym) if isinstance(self.sym, torch.SymInt) else float(self.sym)

    def is_constant(self) -> bool:
        return False

    def truth(self, tx: "Translator") -> bool:
        return bool(self.sym != 0)

    def node_arg(self) -> object:
        return self.node

    def example(self) -> object:
        return self.sym

    def __repr__(self) -> str:
        return f"SymNumberValue({self.node.name}, {self.sym})"


class SymSliceValue(Value):
    """`start:stop:step` with a symbolic size among them (`x[:, : x.shape[1] // 2]`)."""

    def __init__(self, parts: list[Value]):
        self.parts = parts

    def python_type(self) -> type:
        return slice

    def as_constant(self) -> object:
        return slice(*(p.as_constant() for p in self.parts))

    def is_constant(self) -> bool:
        return False

    def node_arg(self) -> object:
        return slice(*(p.node_arg() for p in self.parts))

    def example(self) -> object:
        return slice(*(p.example() for p in self.parts))


def slice_of(parts: list[Value]) -> Value:
    """The Value of `slice(*parts)`."""
    if any(isinstance(p, SymNumberValue) for p in parts):
        return SymSliceValue(parts)
    return ConstantValue(slice(*(p.as_constant() for p in parts)))


class TensorTruthValue(Value):
    """`bool(t)` of a tensor, as CPython 3.13's TO_BOOL (or a comparison a jump reads) leaves
    it for the jump or `not` after it: known only at run time, so that jump or `not` breaks
    the graph, as a jump on the tensor does on 3.11 and 3.12. Rebuilt as `bool(t)`, since
    3.13's jumps read only a real bool."""

    def __init__(self, tensor: TensorValue):
        self.tensor = tensor

    def python_type(self) -> type:
        return bool

    def truth(self, tx: "Translator") -> bool:
        raise Unsupported("data-dependent control flow: branching on a tensor's value")


# ---------------------------------------------------------------------------
# containers
# ---------------------------------------------------------------------------


class SequenceValue(Value):
    container_type: type = tuple

    def __init__(self, items: Iterable[Value], source: Source | None = None):
        self.elements: list[Value] = list(items)
        self.source = source

    def python_type(self) -> type:
        return self.container_type

    def as_constant(self) -> object:
        return self.container_type(v.as_constant() for v in self.elements)

    def is_constant(self) -> bool:  # without as_constant's int() of a symbolic size, which specializes it
        return all(v.is_constant() for v in self.elements)

    def items(self, tx: "Translator") -> list[Value]:
        return list(self.elements)

    def truth(self, tx: "Translator") -> bool:
        return bool(self.elements)

    def node_arg(self) -> object:
        return self.container_type(v.node_arg() for v in self.elements)

    def example(self) -> object:
        return self.container_type(v.example() for v in self.elements)

    def getitem(self, tx: "Translator", key: Value) -> Value:
        index = key.as_constant()
        if isinstance(index, slice):
            return type(self)(self.elements[index])
        try:
            return self.elements[index]
        except IndexError:
            from torchweld.capture.exceptions import CapturedRaise

            raise CapturedRaise.of(IndexError, f"{self.container_type.__name__} index out of range") from None

    def getattr(self, tx: "Translator", name: str) -> Value:
        from torchweld.capture.callables import ContainerMethodValue

        if callable(getattr(self.container_type, name, None)):
            return ContainerMethodValue(self, name)
        raise Unsupported(f"{self.container_type.__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.elements})"


class TupleValue(SequenceValue):
    container_type = tuple

    def __init__(self, items: Iterable[Value], source: Source | None = None, fields: tuple[str, ...] | None = None, tuple_type: type = tuple):
        super().__init__(items, source)
        self.fields = fields  # attribute names of a named tuple (torch.return_types.max, ...)
        self.tuple_type = tuple_type

    def getattr(self, tx: "Translator", name: str) -> Value:
        if self.fields and name in self.fields:
            return self.elements[self.fields.index(name)]
        return super().getattr(tx, name)


class ListValue(SequenceValue):
    container_type = list

    def __init__(self, items: Iterable[Value], source: Source | None = None):
        super().__init__(items, source)
        self.mutated = False  # set by any in-place change; a sourced list that changes is a side effect

    def mutate(self, tx: "Translator") -> None:
        if self.source is not None:  # a list from outside: its final contents are written back
            tx.output.side_effects.changed_container(self)
        self.mutated = True


class DictValue(Value):
    def __init__(self, entries: dict[object, Value], source: Source | None = None, dict_type: type = dict):
        self.entries = dict(entries)  # constant key -> Value
        self.source = source
        self.dict_type = dict_type

    def python_type(self) -> type:
        return self.dict_type

    def as_constant(self) -> object:
        return {k: v.as_constant() for k, v in self.entries.items()}

    def is_constant(self) -> bool:
        return all(v.is_constant() for v in self.entries.values())

    def truth(self, tx: "Translator") -> bool:
        return bool(self.entries)

    def items(self, tx: "Translator") -> list[Value]:
        return [const(k) for k in self.entries]

    def node_arg(self) -> object:
        return {k: v.node_arg() for k, v in self.entries.items()}

    def example(self) -> object:
        return {k: v.example() for k, v in self.entries.items()}

    def getitem(self, tx: "Translator", key: Value) -> Value:
        k = key.as_constant()
        if k not in self.entries:
            from torchweld.capture.exceptions import CapturedRaise

            raise CapturedRaise.of(KeyError, k)
        return self.entries[k]

    def mutate(self, tx: "Translator") -> None:
        if self.source is not None:  # a dict from outside: its final contents are written back
            tx.output.side_effects.changed_container(self)

    def getattr(self, tx: "Translator", name: str) -> Value:
        from torchweld.capture.callables import ContainerMethodValue

        if callable(getattr(dict, name, None)):
            return ContainerMethodValue(self, name)
        raise Unsupported(f"dict has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"DictValue({self.entries})"


class IteratorValue(Value):
    """An iterator over values all known at capture time (FOR_ITER pulls from it)."""

    def __init__(self, remaining: list[Value]):
        self.remaining = list(remaining)

    def next(self) -> Value | None:
        return self.remaining.pop(0) if self.remaining else None

    def items(self, tx: "Translator") -> list[Value]:
        out, self.remaining = self.remaining, []
        return out


class LazyIteratorValue(IteratorValue):
    """`zip(it, ...)` or `enumerate(it)` of an iterator the frame holds too: items are pulled
    from it one at a time, as Python pulls them (`zip(range(2), it)` takes two of `it`'s
    items and leaves the rest for the next loop over `it`)."""

    def __init__(self, step: "Callable[[], Value | None]"):
        self._step = step

    def next(self) -> Value | None:
        return self._step()

    def items(self, tx: "Translator") -> list[Value]:
        out = []
        while (item := self.next()) is not None:
            out.append(item)
        return out

    @property
    def remaining(self) -> list[Value]:
        raise Unsupported("rebuilding, at a graph break, a zip or enumerate over an iterator the frame also holds")


class CellValue(Value):
    """A closure cell made in the frame (MAKE_CELL), shared with nested functions."""

    def __init__(self, contents: Value | None = None):
        self.contents = contents

    def load(self) -> Value:
        if self.contents is None:
            raise Unsupported("free variable referenced before assignment")
        return self.contents


