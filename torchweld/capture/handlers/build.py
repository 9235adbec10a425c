"""Building and unpacking containers, slices and strings."""
from __future__ import annotations

from torchweld.capture.handlers import handles
from torchweld.capture.collection_values import SetValue
from torchweld.capture.exceptions import CapturedRaise
from torchweld.capture.values import ConstantValue, DictValue, ListValue, TensorValue, TupleValue, slice_of
from torchweld.errors import Unsupported


@handles("BUILD_TUPLE")
def build_tuple(tx, inst):
    tx.push(TupleValue(tx.popn(inst.arg)))


@handles("BUILD_LIST")
def build_list(tx, inst):
    tx.push(ListValue(tx.popn(inst.arg)))


@handles("BUILD_SET")
def build_set(tx, inst):
    tx.push(SetValue.of(tx, tx.popn(inst.arg)))


@handles("BUILD_MAP")
def build_map(tx, inst):
    flat = tx.popn(2 * inst.arg)
    tx.push(DictValue({flat[i].as_constant(): flat[i + 1] for i in range(0, len(flat), 2)}))


@handles("BUILD_CONST_KEY_MAP")
def build_const_key_map(tx, inst):
    keys = tx.pop().as_constant()
    values = tx.popn(inst.arg)
    tx.push(DictValue(dict(zip(keys, values))))


@handles("BUILD_SLICE")
def build_slice(tx, inst):
    parts = tx.popn(inst.arg)
    tx.push(slice_of(parts))


@handles("BUILD_STRING")
def build_string(tx, inst):
    parts = tx.popn(inst.arg)
    tx.push(ConstantValue("".join(p.as_constant() for p in parts)))


_CONVERSIONS = {0: lambda x: x, 1: str, 2: repr, 3: ascii}  # f"{x}", f"{x!s}", f"{x!r}", f"{x!a}"


def _known(value):
    if isinstance(value, TensorValue):
        raise Unsupported("formatting a tensor into a string needs its values")
    return value.as_constant()


@handles("FORMAT_VALUE", until=(3, 12))
def format_value(tx, inst):
    spec = tx.pop().as_constant() if inst.arg & 0x04 else ""
    value = _CONVERSIONS[inst.arg & 0x03](_known(tx.pop()))
    tx.push(ConstantValue(format(value, spec)))


@handles("CONVERT_VALUE", since=(3, 13))
def convert_value(tx, inst):
    tx.push(ConstantValue(_CONVERSIONS[inst.arg](_known(tx.pop()))))


@handles("FORMAT_SIMPLE", since=(3, 13))
def format_simple(tx, inst):
    tx.push(ConstantValue(format(_known(tx.pop()))))


@handles("FORMAT_WITH_SPEC", since=(3, 13))
def format_with_spec(tx, inst):
    spec = tx.pop().as_constant()
    tx.push(ConstantValue(format(_known(tx.pop()), spec)))


@handles("LIST_APPEND")
def list_append(tx, inst):
    item = tx.pop()
    tx.stack[-inst.arg].elements.append(item)


@handles("LIST_EXTEND")
def list_extend(tx, inst):
    items = tx.pop().items(tx)
    tx.stack[-inst.arg].elements.extend(items)


@handles("LIST_TO_TUPLE", until=(3, 11))
def list_to_tuple(tx, inst):
    tx.push(TupleValue(tx.pop().items(tx)))


@handles("SET_ADD")
def set_add(tx, inst):
    item = tx.pop()
    tx.stack[-inst.arg].add(tx, item)


@handles("SET_UPDATE")
def set_update(tx, inst):
    items = tx.pop().items(tx)
    target = tx.stack[-inst.arg]
    for item in items:
        target.add(tx, item)


@handles("MAP_ADD")
def map_add(tx, inst):
    value = tx.pop()
    key = tx.pop()
    tx.stack[-inst.arg].entries[key.as_constant()] = value


@handles("DICT_UPDATE", "DICT_MERGE")
def dict_update(tx, inst):
    other = tx.pop()
    if not isinstance(other, DictValue):
        raise Unsupported(f"** on {other}, which is not a dict")
    target = tx.stack[-inst.arg]
    if inst.opname == "DICT_MERGE" and set(target.entries) & set(other.entries):
        raise Unsupported("duplicate keyword arguments (the eager call raises TypeError)")
    target.entries.update(other.entries)


@handles("UNPACK_SEQUENCE")
def unpack_sequence(tx, inst):
    items = tx.pop().items(tx)
    if len(items) != inst.arg:
        raise CapturedRaise.of(ValueError, f"unpacking {len(items)} values into {inst.arg} names")
    tx.stack.extend(reversed(items))


@handles("UNPACK_EX")
def unpack_ex(tx, inst):
    before, after = inst.arg & 0xFF, inst.arg >> 8
    items = tx.pop().items(tx)
    if len(items) < before + after:
        raise CapturedRaise.of(ValueError, "not enough values to unpack")
    middle = ListValue(items[before:len(items) - after])
    ordered = items[:before] + [middle] + items[len(items) - after:]
    tx.stack.extend(reversed(ordered))
