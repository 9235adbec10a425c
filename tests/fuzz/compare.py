"""Compare what an eager call and a compiled call returned or left behind (values,
containers, objects, nn.Modules, functions' defaults), and which outputs alias the
inputs; each difference is a line naming its path (`out[1]`, `args[3]['h'][0]`, `G.OBJ.t`)."""
from __future__ import annotations

import collections
import math
import sys
import types

import numpy as np
import torch
import torch.utils.hooks

SCALARS = (int, str, bytes, bool, type(None), complex, torch.dtype, torch.device, torch.Size, range, slice)
MAX_DEPTH = 12


def type_key(value: object) -> tuple[str, str]:
    """A type by name: the program's own classes are distinct objects in the eager and the
    compiled module, with the same name."""
    return type(value).__module__, type(value).__qualname__


def module_state(module: types.ModuleType) -> dict[str, object]:
    """The names of a program's module that its calls may change: every global but
    imported modules, classes and dunders (functions stay: their defaults and cells count)."""
    state = {}
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, type):
            continue
        if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value:
            continue  # an import (torch, np, collections): not the program's state
        state[name] = value
    return state


class Comparator:
    """Collects differences between an eager value and a compiled one. Floats and tensors
    are compared with torch.testing.assert_close's tolerances (Python floats exactly on the
    capture-only backend, which runs the same operations as eager)."""

    def __init__(self, exact_floats: bool = True, limit: int = 6):
        self.exact_floats = exact_floats
        self.limit = limit
        self.lines: list[str] = []
        self._seen: set[tuple[int, int]] = set()

    def compare(self, eager: object, compiled: object, path: str, depth: int = 0) -> None:
        if len(self.lines) >= self.limit or depth > MAX_DEPTH:
            return
        key = (id(eager), id(compiled))
        if key in self._seen:
            return
        self._seen.add(key)
        if type_key(eager) != type_key(compiled):
            self.add(path, f"type {_type_name(eager)} (eager) != {_type_name(compiled)} (compiled): "
                           f"{_short(eager)} != {_short(compiled)}")
            return
        if isinstance(eager, torch.Tensor):
            self._tensor(eager, compiled, path)
        elif isinstance(eager, np.ndarray):
            self._array(eager, compiled, path)
        elif isinstance(eager, float):
            if not _floats_equal(eager, compiled, self.exact_floats):
                self.add(path, f"{eager!r} (eager) != {compiled!r} (compiled)")
        elif isinstance(eager, SCALARS):
            if eager != compiled:
                self.add(path, f"{eager!r} (eager) != {compiled!r} (compiled)")
        elif isinstance(eager, (list, tuple, collections.deque)):
            self._sequence(eager, compiled, path, depth)
        elif isinstance(eager, dict):
            self._dict(eager, compiled, path, depth)
        elif isinstance(eager, (set, frozenset)):
            if eager != compiled:
                self.add(path, f"{_short(eager)} (eager) != {_short(compiled)} (compiled)")
        elif isinstance(eager, torch.nn.Module):
            self._module(eager, compiled, path, depth)
        elif isinstance(eager, types.FunctionType):
            self._function(eager, compiled, path, depth)
        elif isinstance(eager, types.ModuleType):
            self._attributes(vars(eager), vars(compiled), path, depth)
        elif isinstance(eager, (BaseException, torch.utils.hooks.RemovableHandle)):
            pass  # the same type is all that counts (a handle's id counts handles made anywhere)
        elif hasattr(eager, "__dict__") and not callable(eager):
            self._attributes(vars(eager), vars(compiled), path, depth)

    def add(self, path: str, text: str) -> None:
        if len(self.lines) < self.limit:
            self.lines.append(f"{path}: {text}")

    def _tensor(self, eager: torch.Tensor, compiled: torch.Tensor, path: str) -> None:
        for what in ("shape", "dtype", "device", "requires_grad", "layout"):
            a, b = getattr(eager, what), getattr(compiled, what)
            if a != b:
                self.add(path, f"{what} {a} (eager) != {b} (compiled)")
                return
        try:
            torch.testing.assert_close(compiled.detach(), eager.detach(), equal_nan=True)
        except AssertionError as e:
            detail = " ".join(str(e).split("\n")[:3])
            self.add(path, f"values differ ({detail})\n      eager:    {_short(eager)}\n      compiled: {_short(compiled)}")

    def _array(self, eager: np.ndarray, compiled: np.ndarray, path: str) -> None:
        if eager.shape != compiled.shape or eager.dtype != compiled.dtype:
            self.add(path, f"array {eager.dtype}{eager.shape} (eager) != {compiled.dtype}{compiled.shape} (compiled)")
        elif not np.allclose(eager, compiled, rtol=1.3e-6, atol=1e-5, equal_nan=True):
            self.add(path, f"array values {_short(eager)} (eager) != {_short(compiled)} (compiled)")

    def _sequence(self, eager, compiled, path: str, depth: int) -> None:
        if isinstance(eager, collections.deque) and eager.maxlen != compiled.maxlen:
            self.add(path, f"deque maxlen {eager.maxlen} (eager) != {compiled.maxlen} (compiled)")
        if len(eager) != len(compiled):
            self.add(path, f"length {len(eager)} (eager) != {len(compiled)} (compiled): "
                           f"{_short(eager)} != {_short(compiled)}")
            return
        for i, (a, b) in enumerate(zip(eager, compiled)):
            self.compare(a, b, f"{path}[{i}]", depth + 1)

    def _dict(self, eager: dict, compiled: dict, path: str, depth: int) -> None:
        if isinstance(eager, collections.defaultdict):
            names = [getattr(d.default_factory, "__qualname__", repr(d.default_factory)) for d in (eager, compiled)]
            if names[0] != names[1]:
                self.add(path, f"default_factory {names[0]} (eager) != {names[1]} (compiled)")
        if list(eager) != list(compiled):
            self.add(path, f"keys {list(eager)!r} (eager) != {list(compiled)!r} (compiled)")
            return
        for k in eager:
            self.compare(eager[k], compiled[k], f"{path}[{k!r}]", depth + 1)

    def _attributes(self, eager: dict, compiled: dict, path: str, depth: int) -> None:
        def public(d):
            return {k: v for k, v in d.items() if not k.startswith("__") and not isinstance(v, type)
                    and not (isinstance(v, types.ModuleType) and sys.modules.get(v.__name__) is v)}
        eager, compiled = public(eager), public(compiled)
        if sorted(eager) != sorted(compiled):
            self.add(path, f"attributes {sorted(eager)} (eager) != {sorted(compiled)} (compiled)")
            return
        for k in sorted(eager):
            self.compare(eager[k], compiled[k], f"{path}.{k}", depth + 1)

    def _module(self, eager: torch.nn.Module, compiled: torch.nn.Module, path: str, depth: int) -> None:
        if eager.training != compiled.training:
            self.add(path, f"training {eager.training} (eager) != {compiled.training} (compiled)")
        for hooks in ("_forward_hooks", "_forward_pre_hooks"):
            a, b = len(getattr(eager, hooks)), len(getattr(compiled, hooks))
            if a != b:
                self.add(path, f"{a} {hooks} (eager) != {b} (compiled)")
        for table in ("_parameters", "_buffers", "_modules"):
            self._dict(getattr(eager, table), getattr(compiled, table), path, depth)
        skip = {"training", "_parameters", "_buffers", "_modules"}
        self._attributes({k: v for k, v in vars(eager).items() if not k.startswith("_") and k not in skip},
                         {k: v for k, v in vars(compiled).items() if not k.startswith("_") and k not in skip},
                         path, depth)

    def _function(self, eager: types.FunctionType, compiled: types.FunctionType, path: str, depth: int) -> None:
        if eager.__qualname__ != compiled.__qualname__:
            self.add(path, f"function {eager.__qualname__} (eager) != {compiled.__qualname__} (compiled)")
            return
        self.compare(eager.__defaults__, compiled.__defaults__, f"{path}.__defaults__", depth + 1)
        self.compare(eager.__kwdefaults__, compiled.__kwdefaults__, f"{path}.__kwdefaults__", depth + 1)
        cells = [[c.cell_contents for c in f.__closure__ or () if _cell_filled(c)] for f in (eager, compiled)]
        self.compare(cells[0], cells[1], f"{path}.__closure__", depth + 1)


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _floats_equal(a: float, b: float, exact: bool) -> bool:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    return not exact and math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def _type_name(value: object) -> str:
    return type(value).__qualname__


def _short(value: object, limit: int = 160) -> str:
    try:
        text = repr(value)
    except Exception as e:  # a broken __repr__ must not hide the difference
        text = f"<unprintable {type(value).__name__}: {e}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


# -- aliasing ------------------------------------------------------------------------------------

class ObjectIndex:
    """Where each mutable object and tensor storage reachable from some roots (the call's
    arguments, the module's state) is found, by path, to say which outputs alias them."""

    def __init__(self):
        self.paths: dict[int, list[str]] = collections.defaultdict(list)
        self.storages: list[tuple[int, int, str]] = []  # (start, end, path) of each tensor's storage
        self._alive: list[object] = []  # keeps every indexed object alive: ids are not reused

    def add(self, value: object, path: str, depth: int = 0) -> None:
        if depth > 6 or isinstance(value, SCALARS + (float, types.FunctionType, types.BuiltinFunctionType, type)):
            return
        known = id(value) in self.paths
        if len(self.paths[id(value)]) < 4 and path not in self.paths[id(value)]:
            self.paths[id(value)].append(path)
        self._alive.append(value)
        if known:
            return
        if isinstance(value, torch.Tensor):
            if value.numel() and value.layout == torch.strided:
                storage = value.untyped_storage()
                self.storages.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), path))
        elif isinstance(value, (list, tuple, collections.deque)):
            for i, item in enumerate(value):
                self.add(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for k, item in list(value.items()):
                self.add(item, f"{path}[{k!r}]", depth + 1)
        elif isinstance(value, torch.nn.Module):
            for name, item in list(value._parameters.items()) + list(value._buffers.items()) + list(value._modules.items()):
                self.add(item, f"{path}.{name}", depth + 1)
        elif isinstance(value, (types.ModuleType,)) or (hasattr(value, "__dict__") and not callable(value)):
            for k, item in list(vars(value).items()):
                if not k.startswith("__"):
                    self.add(item, f"{path}.{k}", depth + 1)

    def relation(self, value: object) -> tuple:
        """(paths of the same object, paths of tensors whose storage it shares)."""
        same = tuple(self.paths.get(id(value), ()))
        shares: tuple = ()
        pointer = None
        if isinstance(value, torch.Tensor) and value.numel() and value.layout == torch.strided:
            pointer = value.untyped_storage().data_ptr()
        elif isinstance(value, np.ndarray) and value.size:
            pointer = value.__array_interface__["data"][0]
        if pointer is not None:
            shares = tuple(sorted({p for start, end, p in self.storages if start <= pointer < end}))[:4]
        return same, shares


def output_aliases(result: object, index: ObjectIndex) -> dict[str, tuple]:
    """For each tensor, array or container in the result: the inputs or state it is, or
    shares storage with, and the earlier output it is the same object as."""
    relations: dict[str, tuple] = {}
    first_path: dict[int, str] = {}

    def walk(value, path, depth):
        if depth > 6 or isinstance(value, SCALARS + (float,)) or callable(value):
            return
        if isinstance(value, (torch.Tensor, np.ndarray, list, dict, set, collections.deque)) or hasattr(value, "__dict__"):
            same, shares = index.relation(value)
            relations[path] = (same, shares, first_path.get(id(value)))
            if id(value) in first_path:
                return
            first_path[id(value)] = path
        if isinstance(value, (list, tuple, collections.deque)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for k, item in list(value.items()):
                walk(item, f"{path}[{k!r}]", depth + 1)

    walk(result, "out", 0)
    return relations


def describe_alias(relation: tuple | None) -> str:
    if relation is None:
        return "absent"
    same, shares, earlier = relation
    parts = []
    if same:
        parts.append("is " + " and ".join(same))
    if shares:
        parts.append("shares storage with " + ", ".join(shares))
    if earlier:
        parts.append(f"is the same object as {earlier}")
    return "; ".join(parts) or "aliases no input"
