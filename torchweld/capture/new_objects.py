"""Objects created inside the frame: `Point(x, y)`, a dataclass, transformers'
ModelOutput and DynamicCache.

A class whose instances are plain (created by `object.__new__` or a dict's
`__new__`, attributes in `__dict__`) is constructed symbolically: a
`NewObjectValue` stands for the instance, its `__init__` is inlined, and its
attributes (and, for a dict subclass, its entries) are Values. Python's
attribute lookup is followed: data descriptors of the class, then the instance's
`__dict__`, then the class; a user `__setattr__`, `__getitem__`, `__len__` or
`__getattr__` is inlined like any other method.

Nothing outside sees the object until the graph has run; if it escapes (it is
returned, stored on an outside object, or live at a graph break), the
reconstructor builds it with `cls.__new__(cls)` and fills in its `__dict__` and
entries, which is exactly the state the inlined `__init__` computed.
"""
from __future__ import annotations

import abc
import collections
import collections.abc
import inspect
import types
import typing
from typing import TYPE_CHECKING

import torch

from torchweld.capture.sources import AttrSource, Source
from torchweld.capture.values import ConstantValue, DictValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.objects import ClassValue
    from torchweld.capture.translator import Translator

# builtin bases whose instance layout capture models: attributes in `__dict__`, plus dict entries
_MODELLED_BASES = (object, dict, collections.OrderedDict)
# C-level classes in an MRO that add no state (typing.Generic is a C type on 3.12)
_STATELESS_BUILTIN_BASES = tuple(c for c in (getattr(typing, "Generic", None),) if c is not None)
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined by a class statement


def _builtin_base(cls: type) -> type:
    """The first class of `cls.__mro__` that is not defined in Python."""
    for klass in cls.__mro__:
        if not klass.__flags__ & _HEAP_TYPE and klass not in _STATELESS_BUILTIN_BASES:
            return klass
    return object


def why_not_constructible(cls: type) -> str | None:
    """Why instances of `cls` cannot be built symbolically, or None when they can."""
    if type(cls) not in (type, abc.ABCMeta):
        return f"its metaclass {type(cls).__qualname__} may customise instance creation"
    if issubclass(cls, (torch.nn.Module, torch.Tensor, BaseException)):
        return "modules, tensors and exceptions are not plain objects"
    if inspect.isabstract(cls):
        return "it has abstract methods (the eager call raises TypeError)"
    base = _builtin_base(cls)
    if base not in _MODELLED_BASES:
        return f"it derives from the builtin {base.__qualname__}, whose state capture does not model"
    for klass in cls.__mro__[:cls.__mro__.index(base)]:
        if "__new__" in vars(klass):
            return f"{klass.__qualname__} defines __new__"
        if vars(klass).get("__slots__", ()):  # empty slots (collections.abc) add no state
            return f"{klass.__qualname__} defines __slots__"
    return None


def _lookup(cls: type, name: str, after: type | None = None) -> tuple[type, object] | None:
    """(defining class, raw attribute) of `name` on `cls`, searching the MRO after `after`."""
    mro = cls.__mro__
    start = mro.index(after) + 1 if after is not None else 0
    for klass in mro[start:]:
        if name in vars(klass):
            return klass, vars(klass)[name]
    return None


class NewObjectValue(Value):
    """An instance of a user class made inside the frame."""

    def __init__(self, cls: type, cls_source: Source | None):
        self.cls = cls
        self.cls_source = cls_source  # where the class was read from: its attributes are guarded through it
        self.base = _builtin_base(cls)
        self.attributes = DictValue({})  # the instance's __dict__
        self.entries = DictValue({}, dict_type=self.base) if self.base is not object else None

    def python_type(self) -> type:
        return self.cls

    def truth(self, tx):
        for dunder in ("__bool__", "__len__"):
            found = _lookup(self.cls, dunder)
            if found is not None and isinstance(found[1], types.FunctionType):
                result = self.getattr(tx, dunder).call(tx, [], {})
                return bool(result.as_constant())
        return bool(self.entries.entries) if self.entries is not None else True

    def items(self, tx):
        found = _lookup(self.cls, "__iter__")
        if found is not None and found[1] is collections.abc.Sequence.__iter__:
            # the Sequence mixin indexes until IndexError; its __len__ says where that is
            length = self.getattr(tx, "__len__").call(tx, [], {}).as_constant()
            getitem = self.getattr(tx, "__getitem__")
            return [getitem.call(tx, [ConstantValue(i)], {}) for i in range(length)]
        if found is not None and found[0].__flags__ & _HEAP_TYPE:
            raise Unsupported(f"iterating over a {self.cls.__qualname__} runs its Python __iter__, not captured yet")
        if self.entries is None:
            raise Unsupported(f"{self.cls.__qualname__} object is not iterable")
        return self.entries.items(tx)

    def getitem(self, tx, key: Value) -> Value:
        if self.entries is None:
            raise Unsupported(f"{self.cls.__qualname__} object is not subscriptable")
        return self.entries.getitem(tx, key)

    def setitem(self, tx, key: Value, value: Value) -> None:
        if self.entries is None:
            raise Unsupported(f"{self.cls.__qualname__} object does not support item assignment")
        self.entries.entries[key.as_constant()] = value

    def has_attribute(self, name: str) -> bool:
        if name in self.attributes.entries or _lookup(self.cls, name) is not None:
            return True
        if _lookup(self.cls, "__getattr__") is not None:
            raise Unsupported(f"hasattr on a {self.cls.__qualname__}, whose __getattr__ needs Python")
        return False

    # -- attributes ------------------------------------------------------------------
    def getattr(self, tx, name):
        from torchweld.capture.objects import ClassValue

        if name == "__class__":
            return ClassValue(self.cls, self.cls_source)
        if name == "__dict__":
            return self.attributes
        found = _lookup(self.cls, name)
        if found is not None and _is_data_descriptor(found[1]):
            return self.class_attribute(tx, name)
        if name in self.attributes.entries:
            return self.attributes.entries[name]
        if found is not None:
            return self.class_attribute(tx, name)
        fallback = _lookup(self.cls, "__getattr__")
        if fallback is not None and isinstance(fallback[1], types.FunctionType):
            return self.class_attribute(tx, "__getattr__").call(tx, [ConstantValue(name)], {})
        from torchweld.capture.exceptions import CapturedRaise

        raise CapturedRaise.of(AttributeError, f"{self.cls.__qualname__!r} object has no attribute {name!r}")

    def class_attribute(self, tx: "Translator", name: str, after: type | None = None) -> Value:
        """`name` looked up on the class (from the class after `after`, for `super()`), bound to this object."""
        from torchweld.capture.builder import wrap
        from torchweld.capture.callables import BoundMethodValue
        from torchweld.capture.objects import ClassValue

        found = _lookup(self.cls, name, after)
        if found is None:
            raise Unsupported(f"{self.cls.__qualname__} has no attribute {name!r} after {after}")
        owner, attr = found
        if owner in _MODELLED_BASES:
            return BuiltinBaseMethod(self, owner, name)
        # read through the class that defines it (by super(), one after `after`): class attributes
        # are read anew at each call, and guarded, as any value from outside the frame
        holder = self.cls_source if after is None and self.cls_source is not None else tx.output.guards.source_of(owner)
        source = AttrSource(holder, name)
        if isinstance(attr, property):
            if attr.fget is None:
                raise Unsupported(f"{self.cls.__qualname__}.{name} is a property without a getter")
            return wrap(tx, attr.fget, AttrSource(source, "fget")).call(tx, [self], {})
        if isinstance(attr, types.FunctionType):
            return BoundMethodValue(wrap(tx, attr, source), self)
        if isinstance(attr, classmethod):
            cls_value = ClassValue(self.cls, self.cls_source)
            return BoundMethodValue(wrap(tx, attr.__func__, AttrSource(source, "__func__")), cls_value)
        if isinstance(attr, staticmethod):
            return wrap(tx, attr.__func__, source)
        if _is_data_descriptor(attr) or hasattr(attr, "__get__") and not isinstance(attr, type):
            raise Unsupported(f"{self.cls.__qualname__}.{name} is a descriptor capture does not model")
        return wrap(tx, getattr(owner, name), source)

    def setattr(self, tx, name, value):
        setter = _lookup(self.cls, "__setattr__")
        if setter is not None and isinstance(setter[1], types.FunctionType):
            self.class_attribute(tx, "__setattr__").call(tx, [ConstantValue(name), value], {})
            return
        self.store(tx, name, value)

    def store(self, tx, name: str, value: Value) -> None:
        """`object.__setattr__(self, name, value)`."""
        found = _lookup(self.cls, name)
        if found is not None and isinstance(found[1], property):
            if found[1].fset is None:
                raise Unsupported(f"{self.cls.__qualname__}.{name} is a read-only property (the eager run raises)")
            from torchweld.capture.builder import wrap

            wrap(tx, found[1].fset, None).call(tx, [self, value], {})
            return
        if found is not None and _is_data_descriptor(found[1]):
            raise Unsupported(f"{self.cls.__qualname__}.{name} is a descriptor capture does not model")
        self.attributes.entries[name] = value

    def delete(self, name: str) -> None:
        """`del obj.name`."""
        if name not in self.attributes.entries:
            from torchweld.capture.exceptions import CapturedRaise

            raise CapturedRaise.of(AttributeError, name)
        del self.attributes.entries[name]

    def call(self, tx, args, kwargs):
        if _lookup(self.cls, "__call__") is None:
            raise Unsupported(f"{self.cls.__qualname__} object is not callable")
        return self.class_attribute(tx, "__call__").call(tx, args, kwargs)

    def __repr__(self) -> str:
        return f"NewObjectValue({self.cls.__qualname__})"


def _is_data_descriptor(attr: object) -> bool:
    return not isinstance(attr, type) and (hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__"))


_DICT_READERS = {"__getitem__", "__contains__", "__len__", "__iter__", "get", "keys", "items", "values", "copy"}


class BuiltinBaseMethod(Value):
    """A method of `object`, `dict` or `OrderedDict` reached on a new object, usually
    through `super()`: applied to the object's attributes or entries."""

    def __init__(self, obj: NewObjectValue, base: type, name: str):
        self.obj, self.base, self.name = obj, base, name

    def call(self, tx, args, kwargs):
        from torchweld.capture import operators
        from torchweld.capture.builtins import BUILTINS
        from torchweld.capture.callables import ContainerMethodValue

        obj, name = self.obj, self.name
        if name == "__setattr__":
            obj.store(tx, args[0].as_constant(), args[1])
            return ConstantValue(None)
        if name == "__delattr__":
            obj.attributes.entries.pop(args[0].as_constant(), None)
            return ConstantValue(None)
        if name == "__getattribute__":
            return obj.getattr(tx, args[0].as_constant())
        if name == "__init__":
            if obj.entries is not None and (args or kwargs):
                obj.entries.entries.update(BUILTINS[dict](tx, *args, **kwargs).entries)
            elif args or kwargs:
                raise Unsupported(f"object.__init__() of a {obj.cls.__qualname__} takes no arguments (the eager run raises)")
            return ConstantValue(None)
        if obj.entries is not None and self.base is not object:
            if name == "copy" and self.base is collections.OrderedDict:  # OrderedDict.copy: self.__class__(self)
                copied = NewObjectValue(obj.cls, obj.cls_source)
                copied.entries.entries.update(obj.entries.entries)
                return copied
            if name == "__getitem__":
                return obj.entries.getitem(tx, args[0])
            if name == "__contains__":
                return ConstantValue(operators.contains(tx, args[0], obj.entries))
            if name == "__len__":
                return ConstantValue(len(obj.entries.entries))
            if name in _DICT_READERS or name in ("__setitem__", "__delitem__", "update", "pop", "setdefault", "clear"):
                return ContainerMethodValue(obj.entries, name).call(tx, args, kwargs)
        raise Unsupported(f"{self.base.__qualname__}.{name} on a {obj.cls.__qualname__} made in the frame is not modelled")

    def __repr__(self) -> str:
        return f"BuiltinBaseMethod({self.base.__qualname__}.{self.name})"


def construct(tx: "Translator", cls_value: "ClassValue", args: list[Value], kwargs: dict[str, Value]) -> Value:
    """`cls(*args, **kwargs)` for a plain user class: its `__init__` inlined on a new object."""
    cls = cls_value.cls
    reason = why_not_constructible(cls)
    if reason is not None:
        raise Unsupported(f"creating a {cls.__qualname__} inside a compiled function: {reason}")
    obj = NewObjectValue(cls, cls_value.source)
    result = obj.class_attribute(tx, "__init__").call(tx, args, kwargs)
    if not (isinstance(result, ConstantValue) and result.value is None):
        raise Unsupported(f"{cls.__qualname__}.__init__ returned a value (the eager run raises TypeError)")
    return obj
