"""Python builtins and the `operator` and `math` modules, evaluated on Values at
capture time. One small function per builtin, registered in `BUILTINS`."""
from __future__ import annotations

import builtins
import dataclasses
import functools
import inspect
import operator
from typing import Callable

import torch

from torchweld.capture import operators
from torchweld.capture.collection_values import SetValue
from torchweld.capture.exceptions import CapturedRaise
from torchweld.capture.objects import ClassValue, NNModuleValue
from torchweld.capture.reconstruct import same_object_every_call
from torchweld.capture.sources import Source
from torchweld.capture.values import (
    ConstantValue, DictValue, IteratorValue, LazyIteratorValue, ListValue, SymNumberValue, TensorValue, TupleValue,
    Value, const, slice_of,
)
from torchweld.errors import Unsupported


BuiltinRule = Callable[..., Value]
BUILTINS: dict[object, BuiltinRule] = {}


def rule(*fns: object):
    def register(impl: BuiltinRule) -> BuiltinRule:
        for fn in fns:
            if fn in BUILTINS:
                raise ValueError(f"two rules for builtin {fn}")
            BUILTINS[fn] = impl
        return impl
    return register


def is_modelled_builtin(obj: object) -> bool:
    try:
        if obj in BUILTINS:
            return True
    except TypeError:  # unhashable
        return False
    module = getattr(obj, "__module__", None)
    return module in ("_operator", "math") and callable(obj)


class BuiltinValue(Value):
    def __init__(self, fn: object, source: Source | None = None):
        self.fn = fn
        self.source = source

    def real_object(self) -> object:
        return self.fn

    def python_type(self) -> type:
        return type(self.fn)

    def as_constant(self) -> object:
        return self.fn

    def call(self, tx, args, kwargs):
        impl = BUILTINS.get(self.fn)
        if impl is not None:
            return impl(tx, *args, **kwargs)
        if getattr(self.fn, "__module__", None) == "_operator":
            return _operator_call(tx, self.fn, args)
        return _fold_call(self.fn, args, kwargs)  # math.*

    def __repr__(self) -> str:
        return f"BuiltinValue({getattr(self.fn, '__name__', self.fn)})"


def _fold_call(fn: object, args: list[Value], kwargs: dict[str, Value]) -> Value:
    if any(isinstance(a, TensorValue) for a in [*args, *kwargs.values()]):
        raise Unsupported(f"{fn.__module__}.{fn.__name__} of a tensor needs its value")
    if any(_is_python_callable(a) for a in [*args, *kwargs.values()]):  # it would run unguarded at capture
        raise Unsupported(f"{getattr(fn, '__name__', fn)}() calling a Python function is not folded at capture time")
    for a in [*args, *kwargs.values()]:  # `str(module)`: an answer from state no guard covers
        real = a.real_object()
        if real is not None and not same_object_every_call(real):
            raise Unsupported(f"{getattr(fn, '__name__', fn)}() of a {type(real).__name__} object is not folded at capture time")
    a = [v.as_constant() for v in args]
    k = {n: v.as_constant() for n, v in kwargs.items()}
    try:
        result = fn(*a, **k)
    except Exception as e:  # the eager call raises it: a handler of the frame's may catch it
        raise CapturedRaise.like(e) from None
    return const(result)


_UNARY = {operator.neg, operator.pos, operator.invert, operator.not_, operator.abs, operator.truth}
_COMPARE = {operator.lt, operator.le, operator.eq, operator.ne, operator.gt, operator.ge}


def _operator_call(tx, fn, args: list[Value]) -> Value:
    if fn is operator.getitem:
        return operators.getitem(tx, *args)
    if fn is operator.setitem:
        operators.setitem(tx, *args)
        return ConstantValue(None)
    if fn is operator.is_:
        return ConstantValue(operators.is_same(tx, *args))
    if fn is operator.is_not:
        return ConstantValue(not operators.is_same(tx, *args))
    if fn is operator.contains:
        return ConstantValue(operators.contains(tx, args[1], args[0]))
    if fn in _UNARY:
        return operators.unary(tx, fn, args[0])
    if fn in _COMPARE:
        return operators.compare(tx, fn, *args)
    if len(args) == 2:
        return operators.binary(tx, fn, *args)
    return _fold_call(fn, args, {})


# ---------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------


@rule(len)
def _len(tx, obj: Value) -> Value:
    if isinstance(obj, TensorValue):
        if obj.fake.dim() == 0:
            raise Unsupported("len() of a 0-d tensor")
        if isinstance(obj.fake.shape[0], torch.SymInt):
            return tx.output.call_method("size", [obj, ConstantValue(0)], {})
        return ConstantValue(obj.fake.shape[0])
    if isinstance(obj, NNModuleValue):
        obj.guard_children(tx)
        return ConstantValue(len(obj.module))
    if isinstance(obj, DictValue):
        return ConstantValue(len(obj.entries))
    via_dunder = operators.python_dunder(tx, obj, "__len__", [])
    if via_dunder is not None:
        return via_dunder
    return ConstantValue(len(obj.items(tx)))


def _real_type(v: Value) -> type:
    if isinstance(v, TensorValue):
        return v.cls
    return v.python_type()


@rule(isinstance)
def _isinstance(tx, obj: Value, classes: Value) -> Value:
    return ConstantValue(issubclass(_real_type(obj), classes.as_constant()))


@rule(issubclass)
def _issubclass(tx, cls: Value, classes: Value) -> Value:
    return ConstantValue(issubclass(cls.as_constant(), classes.as_constant()))


@rule(type)
def _type(tx, obj: Value) -> Value:
    return ClassValue(_real_type(obj))


@rule(range)
def _range(tx, *args: Value) -> Value:
    return ConstantValue(range(*(a.as_constant() for a in args)))


@rule(slice)
def _slice(tx, *parts: Value) -> Value:
    """`slice(stop)`, `slice(start, stop[, step])`: what `a[start:stop:step]` builds (transformers'
    `slice(-logits_to_keep, None)`)."""
    if not 1 <= len(parts) <= 3:
        raise Unsupported(f"slice expected 1 to 3 arguments, got {len(parts)}")
    return slice_of([ConstantValue(None), parts[0]] if len(parts) == 1 else list(parts))


@rule(enumerate)
def _enumerate(tx, iterable: Value, start: Value = ConstantValue(0)) -> Value:
    first = start.as_constant()
    if not isinstance(iterable, IteratorValue):
        return ListValue([TupleValue([ConstantValue(first + i), v]) for i, v in enumerate(iterable.items(tx))])
    count = [first]

    def step() -> Value | None:
        item = iterable.next()
        if item is None:
            return None
        count[0] += 1
        return TupleValue([ConstantValue(count[0] - 1), item])

    return LazyIteratorValue(step)


@rule(zip)
def _zip(tx, *iterables: Value, strict: Value = ConstantValue(False)) -> Value:
    if not any(isinstance(it, IteratorValue) for it in iterables):
        columns = [it.items(tx) for it in iterables]
        if strict.as_constant() and len({len(c) for c in columns}) > 1:
            raise Unsupported("zip(strict=True) over iterables of different lengths")
        return ListValue([TupleValue(list(row)) for row in zip(*columns)])
    iterators = [it if isinstance(it, IteratorValue) else IteratorValue(it.items(tx)) for it in iterables]

    def step() -> Value | None:  # as zip pulls: left to right, stopping at the first that is done
        row = []
        for it in iterators:
            item = it.next()
            if item is None:
                if strict.as_constant():
                    raise Unsupported("zip(strict=True) of an iterator: the lengths are checked at run time")
                return None
            row.append(item)
        return TupleValue(row)

    return LazyIteratorValue(step)


@rule(reversed)
def _reversed(tx, seq: Value) -> Value:
    if isinstance(seq, IteratorValue):
        raise Unsupported("reversed() of an iterator (the eager call raises TypeError)")
    return IteratorValue(list(reversed(seq.items(tx))))


@rule(iter)
def _iter(tx, obj: Value) -> Value:
    return obj if isinstance(obj, IteratorValue) else IteratorValue(obj.items(tx))


@rule(next)
def _next(tx, it: Value, *default: Value) -> Value:
    if not isinstance(it, IteratorValue):
        raise Unsupported(f"next() on {it}")
    item = it.next()
    if item is None:
        if default:
            return default[0]
        raise CapturedRaise.of(StopIteration)
    return item


@rule(map)
def _map(tx, fn: Value, *iterables: Value) -> Value:
    """`map(fn, ...)`: an iterator calling `fn` (inlined) as it is pulled, as Python's does."""
    if not iterables:
        raise Unsupported("map() must have at least two arguments (the eager call raises TypeError)")
    rows = _zip(tx, *iterables)
    rows = rows if isinstance(rows, IteratorValue) else IteratorValue(rows.items(tx))

    def step() -> Value | None:
        row = rows.next()
        return None if row is None else fn.call(tx, row.items(tx), {})

    return LazyIteratorValue(step)


@rule(filter)
def _filter(tx, fn: Value, iterable: Value) -> Value:
    """`filter(fn, it)`: the items for which `fn` (inlined), or their own truth for None, holds."""
    items = iterable if isinstance(iterable, IteratorValue) else IteratorValue(iterable.items(tx))
    keep_truthy = fn.is_constant() and fn.as_constant() is None

    def step() -> Value | None:
        while (item := items.next()) is not None:
            if (item if keep_truthy else fn.call(tx, [item], {})).truth(tx):
                return item
        return None

    return LazyIteratorValue(step)


@rule(functools.reduce)
def _reduce(tx, fn: Value, iterable: Value, *initial: Value) -> Value:
    items = list(_one_at_a_time(tx, iterable))
    if initial:
        items.insert(0, initial[0])
    if not items:
        raise Unsupported("reduce() of an empty iterable with no initial value (the eager call raises TypeError)")
    total = items[0]
    for item in items[1:]:
        total = fn.call(tx, [total, item], {})
    return total


@rule(list)
def _list(tx, iterable: Value | None = None) -> Value:
    return ListValue([] if iterable is None else iterable.items(tx))


@rule(tuple)
def _tuple(tx, iterable: Value | None = None) -> Value:
    return TupleValue([] if iterable is None else iterable.items(tx))


@rule(set)
def _set(tx, iterable: Value | None = None) -> Value:
    return SetValue.of(tx, [] if iterable is None else iterable.items(tx))


@rule(frozenset)
def _frozenset(tx, iterable: Value | None = None) -> Value:
    return SetValue.of(tx, [] if iterable is None else iterable.items(tx), frozen=True)


@rule(dict)
def _dict(tx, *args: Value, **kwargs: Value) -> Value:
    from torchweld.capture.new_objects import NewObjectValue

    entries: dict[object, Value] = {}
    if args:
        source = args[0]
        if isinstance(source, NewObjectValue) and source.entries is not None:  # an OrderedDict made in the frame
            source = source.entries
        if isinstance(source, DictValue):
            entries.update(source.entries)
        else:
            for pair in source.items(tx):
                items = pair.items(tx)
                if len(items) != 2:
                    raise Unsupported("dict() of an item that is not a pair (the eager call raises)")
                entries[items[0].as_constant()] = items[1]
    entries.update(kwargs)
    return DictValue(entries)


def _is_python_callable(value: Value) -> bool:
    from torchweld.capture.callables import (
        BoundMethodValue, CachedFunctionValue, NestedFunctionValue, PartialValue, UserFunctionValue,
    )

    return isinstance(value, (UserFunctionValue, NestedFunctionValue, BoundMethodValue, PartialValue, CachedFunctionValue))


def _keyed(tx, items: list[Value], key: Value) -> list[tuple[object, Value]]:
    """(key(item), item) for each item, the key function inlined: what it reads is guarded."""
    if key.is_constant() and key.as_constant() is None:
        return [(item.as_constant(), item) for item in items]
    keyed = []
    for item in items:
        k = key.call(tx, [item], {})
        if isinstance(k, TensorValue):
            raise Unsupported("a sort key that is a tensor compares tensor values")
        keyed.append((k.as_constant(), item))
    return keyed


@rule(sorted)
def _sorted(tx, iterable: Value, key: Value = ConstantValue(None), reverse: Value = ConstantValue(False)) -> Value:
    keyed = _keyed(tx, iterable.items(tx), key)
    try:  # sorted is stable, reverse=True too: sort the (key, position) pairs, not the items
        order = sorted(range(len(keyed)), key=lambda i: keyed[i][0], reverse=reverse.as_constant())
    except TypeError as e:
        raise Unsupported(f"sorted() raised TypeError: {e} at capture time") from None
    return ListValue([keyed[i][1] for i in order])


def _min_max(fn):
    def impl(tx, *args: Value, key: Value = ConstantValue(None), **kwargs: Value) -> Value:
        if any(isinstance(a, TensorValue) for a in args):
            if len(args) == 2 and not kwargs and key.is_constant() and key.as_constant() is None:
                target = torch.maximum if fn is max else torch.minimum
                if all(isinstance(a, TensorValue) for a in args):
                    return tx.output.call_function(target, list(args), {})
            raise Unsupported(f"{fn.__name__}() of tensors needs their values")
        if len(args) == 2 and not kwargs and key.is_constant() and key.as_constant() is None \
                and any(isinstance(a, SymNumberValue) for a in args) and all(_is_int(a) for a in args):
            # `min(x.shape[0], 4)`: a symbolic size, not one compile per size
            return tx.output.call_function(torch.sym_max if fn is max else torch.sym_min, list(args), {})
        items = args[0].items(tx) if len(args) == 1 else list(args)
        if not items:
            if "default" in kwargs:
                return kwargs["default"]
            raise CapturedRaise.of(ValueError, f"{fn.__name__}() arg is an empty sequence")
        keyed = _keyed(tx, items, key)
        try:
            best = fn(range(len(keyed)), key=lambda i: keyed[i][0])  # the first of equals, as Python picks
        except TypeError as e:
            raise Unsupported(f"{fn.__name__}() raised TypeError: {e} at capture time") from None
        return keyed[best][1]
    return impl


def _is_int(value: Value) -> bool:
    if isinstance(value, SymNumberValue):
        return isinstance(value.sym, torch.SymInt)
    return value.is_constant() and type(value.as_constant()) is int


rule(min)(_min_max(min))
rule(max)(_min_max(max))


@rule(abs)
def _abs(tx, x: Value) -> Value:
    return operators.unary(tx, operator.abs, x)


@rule(sum)
def _sum(tx, iterable: Value, start: Value = ConstantValue(0)) -> Value:
    if isinstance(iterable, TensorValue):
        raise Unsupported("sum() over a tensor's values needs them; use tensor.sum()")
    total = start
    for item in iterable.items(tx):
        total = operators.binary(tx, operator.add, total, item)
    return total


def _one_at_a_time(tx, iterable: Value):
    """The items of `iterable`, pulled lazily from an iterator (`any` stops at the first true one)."""
    if not isinstance(iterable, IteratorValue):
        yield from iterable.items(tx)
        return
    while (item := iterable.next()) is not None:
        yield item


@rule(any)
def _any(tx, iterable: Value) -> Value:
    return ConstantValue(any(i.truth(tx) for i in _one_at_a_time(tx, iterable)))


@rule(all)
def _all(tx, iterable: Value) -> Value:
    return ConstantValue(all(i.truth(tx) for i in _one_at_a_time(tx, iterable)))


@rule(bool)
def _bool(tx, x: Value = ConstantValue(False)) -> Value:
    return ConstantValue(x.truth(tx))


def _number(fn):
    def impl(tx, *args: Value) -> Value:
        if any(isinstance(a, TensorValue) for a in args):
            raise Unsupported(f"data-dependent: {fn.__name__}() of a tensor reads its value out of the graph")
        if fn in (int, float) and len(args) == 1 and isinstance(args[0], SymNumberValue):
            # `float(n)` of a symbolic int stays symbolic (torch.sym_float), as torch.compile keeps it
            if args[0].python_type() is fn:
                return args[0]
            if fn is float:
                return tx.output.call_function(torch.sym_float, [args[0]], {})
        return _fold_call(fn, list(args), {})
    return impl


for _fn in (int, float, complex, str, round, divmod, hash, repr, chr, ord, pow):
    rule(_fn)(_number(_fn))


@rule(callable)
def _callable(tx, obj: Value) -> Value:
    return ConstantValue(hasattr(obj, "call") and type(obj).call is not Value.call)


@rule(getattr)
def _getattr(tx, obj: Value, name: Value, *default: Value) -> Value:
    attr = name.as_constant()
    if default and not _hasattr(tx, obj, name).as_constant():
        return default[0]
    return obj.getattr(tx, attr)


@rule(hasattr)
def _hasattr(tx, obj: Value, name: Value) -> Value:
    from torchweld.capture.new_objects import NewObjectValue

    attr = name.as_constant()
    if isinstance(obj, TensorValue):
        return ConstantValue(hasattr(obj.fake, attr))
    if isinstance(obj, NewObjectValue):
        return ConstantValue(obj.has_attribute(attr))
    real = obj.real_object()
    if real is not None:
        present = hasattr(real, attr)
        if obj.source is not None:
            tx.output.guards.has_attr(obj.source, attr, present)
        return ConstantValue(present)
    return ConstantValue(hasattr(obj.as_constant(), attr))


def _class_of(obj: Value) -> type:
    from torchweld.capture.objects import ClassValue

    return obj.as_constant() if isinstance(obj, ClassValue) else _real_type(obj)


@rule(dataclasses.fields)
def _dataclass_fields(tx, obj: Value) -> Value:
    """Read from the class, which capture knows (guarded by identity or by the object's
    type): the Field objects are metadata nobody mutates, held as constants."""
    try:
        return TupleValue([ConstantValue(f) for f in dataclasses.fields(_class_of(obj))])
    except TypeError as e:
        raise Unsupported(f"dataclasses.fields raised TypeError: {e}") from None


@rule(dataclasses.is_dataclass)
def _is_dataclass(tx, obj: Value) -> Value:
    return ConstantValue(dataclasses.is_dataclass(_class_of(obj)))


@rule(object.__setattr__)
def _object_setattr(tx, obj: Value, name: Value, value: Value) -> Value:
    """`object.__setattr__(self, name, value)`, as frozen dataclasses' __init__ spells it."""
    from torchweld.capture.new_objects import NewObjectValue

    if not isinstance(obj, NewObjectValue):
        raise Unsupported(f"object.__setattr__ on {obj}, an object from outside the frame")
    obj.store(tx, name.as_constant(), value)
    return ConstantValue(None)


@rule(id)
def _id(tx, obj: Value) -> Value:
    raise Unsupported("id() of an object inside a compiled function")


@rule(builtins.print)
def _print(tx, *args: Value, **kwargs: Value) -> Value:
    raise Unsupported("print() needs Python")


@rule(super)
def _super(tx, *args: Value) -> Value:
    from torchweld.capture.objects import SuperValue

    if len(args) == 2:
        return SuperValue(args[0].as_constant(), args[1])
    if args or "__class__" not in tx.cells or not tx.code.co_argcount:
        raise Unsupported("super() outside a method")
    cls = tx.cells["__class__"]
    cls = cls.load(tx) if hasattr(cls, "cell") else cls.load()
    return SuperValue(cls.as_constant(), tx.load_local(tx.code.co_varnames[0]))



@rule(inspect.signature)
def _signature(tx, fn: Value, **kwargs: Value) -> Value:
    """Pure for a function guarded by identity: evaluated at capture time."""
    from torchweld.capture.callables import BoundMethodValue, UserFunctionValue

    options = {k: v.as_constant() for k, v in kwargs.items()}
    if isinstance(fn, UserFunctionValue):
        return ConstantValue(inspect.signature(fn.fn, **options))
    if isinstance(fn, BoundMethodValue) and isinstance(fn.func, UserFunctionValue):
        return ConstantValue(inspect.signature(fn.func.fn, **options).replace(
            parameters=list(inspect.signature(fn.func.fn).parameters.values())[1:]))
    raise Unsupported(f"inspect.signature of {fn}")
