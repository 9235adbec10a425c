"""Mutations of objects from outside the frame — attribute stores, global stores,
changes to argument lists and dicts — recorded during capture, seen by later
reads in the same frame, and replayed as Python statements right after the
graph has run (before a break's native instruction, or before returning)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchweld.capture.values import DictValue, ListValue, Value

if TYPE_CHECKING:
    from torchweld.capture.reconstruct import Reconstructor


class SideEffects:
    def __init__(self) -> None:
        # (id(object), attribute) -> (the object's Value, attribute, stored Value), in program order
        self._attributes: dict[tuple[int, str], tuple[Value, str, Value]] = {}
        self._globals: dict[tuple[int, str], tuple[str, str, Value]] = {}  # -> (globals expr, name, Value)
        self._containers: dict[int, Value] = {}  # sourced lists and dicts that changed
        self._keep_alive: list[object] = []  # ids above stay unique while capture runs
        self._recorded = 0  # how many changes were recorded: a snapshot to compare

    # -- recording ------------------------------------------------------------------
    def snapshot(self) -> int:
        """A mark that changes whenever a change is recorded (checkpoint.py compares two)."""
        return self._recorded

    def store_attribute(self, owner: Value, real: object, name: str, value: Value) -> None:
        self._recorded += 1
        self._keep_alive.append(real)
        self._attributes.pop((id(real), name), None)  # re-inserted last: replay in program order
        self._attributes[(id(real), name)] = (owner, name, value)

    def stored_attribute(self, real: object, name: str) -> Value | None:
        entry = self._attributes.get((id(real), name))
        return entry[2] if entry else None

    def store_global(self, f_globals: dict, globals_expr: str, name: str, value: Value) -> None:
        self._recorded += 1
        self._keep_alive.append(f_globals)
        self._globals.pop((id(f_globals), name), None)
        self._globals[(id(f_globals), name)] = (globals_expr, name, value)

    def stored_global(self, f_globals: dict, name: str) -> Value | None:
        entry = self._globals.get((id(f_globals), name))
        return entry[2] if entry else None

    def changed_container(self, container: Value) -> None:
        self._recorded += 1
        self._containers[id(container)] = container

    def __bool__(self) -> bool:
        return bool(self._attributes or self._globals or self._containers)

    # -- replay ---------------------------------------------------------------------
    def replay(self, rebuild: "Reconstructor") -> list[str]:
        """Statements that leave every outside object as eager execution would."""
        lines = []
        for container in self._containers.values():
            target = rebuild.expr(container)  # read before any write, as every value replay uses
            if isinstance(container, ListValue):
                items = ", ".join(rebuild.expr(v) for v in container.elements)
                lines.append(f"{target}[:] = [{items}]")
            elif isinstance(container, DictValue):
                items = ", ".join(f"{rebuild.const(k)}: {rebuild.expr(v)}" for k, v in container.entries.items())
                lines += [f"{target}.clear()", f"{target}.update({{{items}}})"]
        for owner, name, value in self._attributes.values():
            lines.append(f"setattr({rebuild.expr(owner)}, {name!r}, {rebuild.expr(value)})")
        for globals_expr, name, value in self._globals.values():
            lines.append(f"{globals_expr}[{name!r}] = {rebuild.expr(value)}")
        return lines
