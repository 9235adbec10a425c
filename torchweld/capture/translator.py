"""The symbolic interpreter: runs one frame's bytecode over Values instead of
objects, recording tensor operations into the frame's OutputGraph.

Each opcode is one small function in `handlers/`, registered by name in
`handlers.HANDLERS`; an opcode with no handler stops the capture with the
reason `unsupported opcode X`. Inlined calls run a child Translator that shares
its parent's OutputGraph.
"""
from __future__ import annotations

import dis
import functools
import inspect
import sys
import types

from torchweld.capture.exceptions import CapturedRaise, unwind
from torchweld.capture.output_graph import OutputGraph
from torchweld.capture.sources import BuiltinSource, GlobalSource, GlobalsSource, ModuleGlobalSource, Source
from torchweld.capture.values import CellValue, Value
from torchweld.errors import Unsupported, UserLocation


@functools.lru_cache(maxsize=512)
def instructions_of(code: types.CodeType) -> tuple[tuple[dis.Instruction, ...], dict[int, int]]:
    insts = tuple(dis.get_instructions(code))
    return insts, {inst.offset: i for i, inst in enumerate(insts)}


class StopBeforeBreak(Exception):
    """Raised by the top-level Translator when it reaches the instruction at which
    a previous attempt found it must break the graph; its state is intact."""


class Translator:
    def __init__(
        self,
        code: types.CodeType,
        f_globals: dict,
        output: OutputGraph,
        symbolic_locals: dict[str, Value],
        cells: dict[str, Value],
        parent: "Translator | None" = None,
        pending_locals: dict[str, object] | None = None,
    ):
        from torchweld.capture.handlers import HANDLERS

        self.handlers = HANDLERS
        self.code = code
        self.f_globals = f_globals
        self.f_builtins = f_globals.get("__builtins__", __builtins__)
        if isinstance(self.f_builtins, types.ModuleType):
            self.f_builtins = vars(self.f_builtins)
        self.output = output
        self.locals = symbolic_locals
        self.pending_locals = pending_locals or {}  # real objects, wrapped on first read
        self.cells = cells
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.instructions, self.index_of_offset = instructions_of(code)
        self.stack: list[Value] = []
        self.ip = 0
        self.kw_names: tuple[str, ...] | None = None
        self.lineno = code.co_firstlineno
        self.returned: Value | None = None
        self.stop_at: tuple[int, int] | None = None  # (instruction index, visit) to stop before
        self.visits: dict[int, int] = {}  # how often the top-level frame reached each instruction
        self.yielded: list[Value] | None = None  # a generator expression run to completion collects here
        self.exc_stack: list[Value] = []  # the exceptions being handled (PUSH_EXC_INFO ... POP_EXCEPT)
        self.is_generator = False  # a generator's body, run a step at a time (capture/generators.py)
        self.paused_at: Value | None = None  # what its last step yielded

    # -- running ---------------------------------------------------------------
    def run(self) -> Value:
        self.output.translators.append(self)  # where a guard on a symbolic size is made
        try:
            return self._run()
        finally:
            self.output.translators.pop()

    def _run(self) -> Value:
        while self.returned is None and self.paused_at is None:
            if self.ip >= len(self.instructions):
                raise Unsupported("fell off the end of the bytecode").at(self.location())
            inst = self.instructions[self.ip]
            if inst.positions is not None and inst.positions.lineno is not None:
                self.lineno = inst.positions.lineno
            if self.parent is None:
                visit = self.visits[self.ip] = self.visits.get(self.ip, 0) + 1
                if self.stop_at == (self.ip, visit):
                    raise StopBeforeBreak()
            self.ip += 1
            handler = self.handlers.get(inst.opname)
            try:
                if handler is None:
                    raise Unsupported(f"unsupported opcode {inst.opname}")
                try:
                    handler(self, inst)
                except CapturedRaise as raised:
                    self._unwind(raised)
            except Unsupported as e:
                located = e.at(self.location())
                if self.parent is None and located.break_point is None:
                    located.break_point = (self.ip - 1, self.visits[self.ip - 1])
                raise located from e.__cause__
        return self.returned

    def _unwind(self, raised: CapturedRaise) -> None:
        """Send an exception the last instruction raised to this frame's handler for it; without
        one, to the caller's instruction (an inlined call) or, at the top, end the capture there."""
        if self.output.model_exceptions and unwind(self, raised, self.ip - 1):
            self.output.caught_raise = True
            return
        if self.output.model_exceptions and self.parent is not None:
            raise raised
        name = raised.value.exc_type.__name__
        raise Unsupported(f"raises {name} (the eager run raises it, and no captured handler catches it)")

    def location(self) -> UserLocation:
        return UserLocation(self.code.co_filename, self.lineno, self.code.co_name)

    # -- stack -----------------------------------------------------------------
    def push(self, value: Value) -> None:
        self.stack.append(value)

    def pop(self) -> Value:
        return self.stack.pop()

    def popn(self, n: int) -> list[Value]:
        if n == 0:
            return []
        values = self.stack[-n:]
        del self.stack[-n:]
        return values

    def jump_to(self, offset: int) -> None:
        self.ip = self.index_of_offset[offset]

    # -- names -----------------------------------------------------------------
    def load_local(self, name: str) -> Value:
        if name in self.locals:
            return self.locals[name]
        if name in self.pending_locals:
            from torchweld.capture.builder import wrap
            from torchweld.capture.sources import LocalSource

            value = wrap(self, self.pending_locals.pop(name), LocalSource(name))
            if name in self._fresh_containers():  # *args/**kwargs are made anew by each call:
                value.source = None  # changing them is no side effect (their items keep sources)
            self.locals[name] = value
            return value
        raise Unsupported(f"local variable {name!r} referenced before assignment")

    def _fresh_containers(self) -> tuple[str, ...]:
        code = self.code
        index = code.co_argcount + code.co_kwonlyargcount
        names = []
        for flag in (inspect.CO_VARARGS, inspect.CO_VARKEYWORDS):
            if code.co_flags & flag:
                names.append(code.co_varnames[index])
                index += 1
        return tuple(names)

    def store_local(self, name: str, value: Value) -> None:
        self.pending_locals.pop(name, None)
        self.locals[name] = value

    def load_global(self, name: str) -> Value:
        from torchweld.capture.builder import wrap

        stored = self.output.side_effects.stored_global(self.f_globals, name)
        if stored is not None:
            return stored
        if name in self.f_globals:
            return wrap(self, self.f_globals[name], self._global_source(name))
        if name in self.f_builtins:
            # builtins are trusted not to change, but a global of that name defined later hides them
            module = None if self.f_globals is self.output.root_globals else self.f_globals.get("__name__")
            self.output.guards.lacks(GlobalsSource(module), name)
            return wrap(self, self.f_builtins[name], BuiltinSource(name), guard=False)
        raise Unsupported(f"name {name!r} is not defined")

    def store_global(self, name: str, value: Value) -> None:
        """`global name; name = value`: replayed into the module's globals after the graph."""
        source = self._global_source(name)  # G['name'] or another module's dict
        globals_expr = source.expr().rsplit("[", 1)[0]
        self.output.side_effects.store_global(self.f_globals, globals_expr, name, value)

    def _global_source(self, name: str) -> Source:
        if self.f_globals is self.output.root_globals:
            return GlobalSource(name)
        module = self.f_globals.get("__name__")
        if getattr(sys.modules.get(module), "__dict__", None) is not self.f_globals:
            raise Unsupported(f"global {name!r} of a function whose module cannot be found")
        return ModuleGlobalSource(module, name)

    def cell(self, name: str) -> Value:
        if name not in self.cells:
            self.cells[name] = CellValue()
        return self.cells[name]
