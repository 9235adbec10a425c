"""Sets, `collections.deque` and `collections.defaultdict` made in the frame: containers
whose operations capture runs itself, so that code building them needs no graph break.

A set holds constants only, as a real Python set that each operation changes as eager
would (its iteration order is then eager's too). A deque holds any values, a list of them
plus its `maxlen`. A defaultdict is a dict value that calls its factory (inlined) for a
missing key. Each is rebuilt anew at every call where it leaves the frame (reconstruct.py).
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Iterable

from torchweld.capture.values import ConstantValue, DictValue, ListValue, TensorValue, Value, const
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


def _constants(tx: "Translator", values: Iterable[Value]) -> list:
    out = []
    for v in values:
        if isinstance(v, TensorValue):
            raise Unsupported("a set of tensors hashes them by identity; capture does not model it")
        out.append(v.as_constant())
    return out


# ---------------------------------------------------------------------------
# sets
# ---------------------------------------------------------------------------


class SetValue(Value):
    """A set (or frozenset) of constants made in the frame."""

    def __init__(self, members: Iterable[object] = (), frozen: bool = False):
        self.value = (frozenset if frozen else set)(members)

    @classmethod
    def of(cls, tx: "Translator", values: Iterable[Value], frozen: bool = False) -> "SetValue":
        return cls(_constants(tx, values), frozen)

    def python_type(self) -> type:
        return type(self.value)

    def as_constant(self) -> object:
        return type(self.value)(self.value)  # a copy: what capture folds never aliases the set

    def items(self, tx: "Translator") -> list[Value]:
        return [const(v) for v in self.value]

    def truth(self, tx: "Translator") -> bool:
        return bool(self.value)

    def add(self, tx: "Translator", item: Value) -> None:
        self.value.add(*_constants(tx, [item]))

    def getattr(self, tx: "Translator", name: str) -> Value:
        if name in _SET_METHODS and (name not in _SET_MUTATORS or isinstance(self.value, set)):
            return SetMethodValue(self, name)
        raise Unsupported(f"{type(self.value).__name__} has no attribute {name!r} capture models")


_SET_MUTATORS = {"add", "discard", "remove", "update", "clear", "pop", "difference_update", "intersection_update",
                 "symmetric_difference_update"}
_SET_METHODS = _SET_MUTATORS | {"union", "intersection", "difference", "symmetric_difference", "issubset",
                                "issuperset", "isdisjoint", "copy", "__contains__", "__len__"}


class SetMethodValue(Value):
    """`s.add`, `s.union`, ... of a set made in the frame, run on it at capture time."""

    def __init__(self, owner: SetValue, name: str):
        self.owner, self.name = owner, name

    def call(self, tx, args, kwargs):
        if kwargs:
            raise Unsupported(f"set.{self.name}() takes no keyword arguments (the eager call raises TypeError)")
        owner = self.owner.value
        if self.name in ("add", "discard", "remove", "__contains__"):
            operands = _constants(tx, args)
        else:  # the others take iterables
            operands = [set(_constants(tx, a.items(tx))) for a in args]
        try:
            result = getattr(owner, self.name)(*operands)
        except (KeyError, TypeError) as e:  # remove() of a missing member, pop() of an empty set
            raise Unsupported(f"set.{self.name}() raised {type(e).__name__}: {e} (the eager run raises it)") from None
        if isinstance(result, (set, frozenset)):
            return SetValue(result, frozen=isinstance(result, frozenset))
        return const(result)


def set_operator(tx: "Translator", plain, in_place: bool, a: Value, b: Value) -> Value | None:
    """`a | b`, `a &= b`, ... where a set value takes part; None where neither is one."""
    import operator

    if not (isinstance(a, SetValue) or isinstance(b, SetValue)) or plain not in _SET_OPERATORS:
        return None
    left, right = (x.value if isinstance(x, SetValue) else x.as_constant() for x in (a, b))
    if not isinstance(left, (set, frozenset)) or not isinstance(right, (set, frozenset)):
        raise Unsupported(f"operator {plain.__name__} on {type(left).__name__} and {type(right).__name__}")
    if in_place and isinstance(a, SetValue) and isinstance(a.value, set):
        getattr(operator, f"i{plain.__name__.rstrip('_')}")(a.value, right)
        return a
    result = plain(left, right)
    return SetValue(result, frozen=isinstance(result, frozenset))


def _set_operators():
    import operator

    return {operator.or_, operator.and_, operator.sub, operator.xor}


_SET_OPERATORS = _set_operators()


# ---------------------------------------------------------------------------
# deques
# ---------------------------------------------------------------------------


class DequeValue(ListValue):
    """A `collections.deque` made in the frame: its items (any values) and its maxlen."""

    container_type = collections.deque

    def __init__(self, items: Iterable[Value], maxlen: int | None = None):
        super().__init__(items)
        self.maxlen = maxlen
        self._trim(left=True)

    def as_constant(self) -> object:
        return collections.deque((v.as_constant() for v in self.elements), self.maxlen)

    def getitem(self, tx, key):
        if isinstance(key.as_constant(), slice):
            raise Unsupported("slicing a deque (the eager run raises TypeError)")
        return super().getitem(tx, key)

    def getattr(self, tx, name):
        if name == "maxlen":
            return ConstantValue(self.maxlen)
        if name in _DEQUE_METHODS:
            return DequeMethodValue(self, name)
        raise Unsupported(f"deque has no attribute {name!r} capture models")

    def _trim(self, left: bool) -> None:
        """Drop items past maxlen from the end opposite to where they were added."""
        while self.maxlen is not None and len(self.elements) > self.maxlen:
            self.elements.pop(0 if left else -1)


_DEQUE_METHODS = {"append", "appendleft", "pop", "popleft", "extend", "extendleft", "clear", "rotate", "reverse",
                  "copy", "index", "count", "insert", "remove"}


class DequeMethodValue(Value):
    def __init__(self, owner: DequeValue, name: str):
        self.owner, self.name = owner, name

    def call(self, tx, args, kwargs):
        q, items, name = self.owner, self.owner.elements, self.name
        if kwargs:
            raise Unsupported(f"deque.{name}() takes no keyword arguments here")
        if name == "append":
            items.append(args[0])
            q._trim(left=True)
        elif name == "appendleft":
            items.insert(0, args[0])
            q._trim(left=False)
        elif name == "extend":
            for item in args[0].items(tx):
                items.append(item)
                q._trim(left=True)
        elif name == "extendleft":
            for item in args[0].items(tx):
                items.insert(0, item)
                q._trim(left=False)
        elif name in ("pop", "popleft"):
            if args or not items:
                raise Unsupported(f"deque.{name}() of an empty deque or with arguments (the eager run raises)")
            return items.pop(-1 if name == "pop" else 0)
        elif name == "clear":
            items.clear()
        elif name == "reverse":
            items.reverse()
        elif name == "rotate":
            n = args[0].as_constant() if args else 1
            if items:
                n %= len(items)
                items[:] = items[len(items) - n:] + items[:len(items) - n]
        elif name == "copy":
            return DequeValue(items, q.maxlen)
        elif name in ("index", "count"):
            constants = q.as_constant()
            try:
                return const(getattr(constants, name)(*_constants(tx, args)))
            except ValueError as e:
                raise Unsupported(f"deque.{name}() raised ValueError: {e} (the eager run raises it)") from None
        else:
            raise Unsupported(f"deque.{name}() is not modelled")
        return ConstantValue(None)


# ---------------------------------------------------------------------------
# defaultdicts
# ---------------------------------------------------------------------------


class DefaultDictValue(DictValue):
    """A `collections.defaultdict` made in the frame: reading a missing key calls the factory."""

    def __init__(self, factory: Value, entries: dict[object, Value]):
        super().__init__(entries, dict_type=collections.defaultdict)
        self.factory = factory

    def getitem(self, tx, key):
        k = key.as_constant()
        if k not in self.entries and not (self.factory.is_constant() and self.factory.as_constant() is None):
            self.entries[k] = self.factory.call(tx, [], {})
        return super().getitem(tx, key)

    def getattr(self, tx, name):
        if name == "default_factory":
            return self.factory
        if name == "copy":
            return _DefaultDictCopy(self)
        return super().getattr(tx, name)


class _DefaultDictCopy(Value):
    def __init__(self, owner: DefaultDictValue):
        self.owner = owner

    def call(self, tx, args, kwargs):
        return DefaultDictValue(self.owner.factory, self.owner.entries)


# ---------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------

COLLECTION_CLASSES = (collections.deque, collections.defaultdict)


def construct_collection(tx: "Translator", cls: type, args: list[Value], kwargs: dict[str, Value]) -> Value:
    """`collections.deque(...)` or `collections.defaultdict(...)` made in the frame."""
    from torchweld.capture.builtins import BUILTINS

    if cls is collections.deque:
        if len(args) > 2 or set(kwargs) - {"iterable", "maxlen"}:
            raise Unsupported("deque() with other arguments (the eager call raises TypeError)")
        iterable = args[0] if args else kwargs.get("iterable")
        maxlen = args[1] if len(args) > 1 else kwargs.get("maxlen", ConstantValue(None))
        return DequeValue(iterable.items(tx) if iterable is not None else [], maxlen.as_constant())
    factory = args[0] if args else ConstantValue(None)
    entries = BUILTINS[dict](tx, *args[1:], **kwargs).entries
    return DefaultDictValue(factory, entries)
