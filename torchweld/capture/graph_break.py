"""The code that runs at a graph break: after the graph so far has run, rebuild
the stack and the live locals as real objects, run the breaking instruction
natively, and continue in a resume function (compiled lazily, with its own cache).

Breakable instructions are those whose effect is one Python statement: calls,
jumps on a value, attribute and item stores, binary operators, subscripts.
"""
from __future__ import annotations

import dis
import functools
import sys
import types
from typing import TYPE_CHECKING

from torchweld.capture.callables import (
    BoundMethodValue, ConstantMethodValue, ContainerMethodValue, TensorMethodValue, UserFunctionValue,
)
from torchweld.capture.ddp import ddp_forward, is_ddp
from torchweld.capture.native_hooks import NativeHooksCall, is_fsdp_managed
from torchweld.capture.handlers import CALLABLE_BELOW_NULL
from torchweld.capture.handlers.calls import callable_and_args
from torchweld.capture.handlers.ops import compare_makes_bool
from torchweld.capture.objects import NNModuleValue, _has_hooks, guard_plain_call, is_standard_module
from torchweld.capture.reconstruct import Reconstructor
from torchweld.capture.resume import (
    ITERATOR, NULL_SLOT, VALUE, Continuation, Handoff, live_locals_at, make_resume_code,
)
from torchweld.capture.sources import LocalSource
from torchweld.capture.values import CellValue, IteratorValue, NullValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.convert_frame import CompileSettings
    from torchweld.capture.translator import Translator

_JUMPS_ON_TRUTH = {
    "POP_JUMP_IF_TRUE": True, "POP_JUMP_IF_FALSE": False,
    "POP_JUMP_FORWARD_IF_TRUE": True, "POP_JUMP_FORWARD_IF_FALSE": False,
    "POP_JUMP_BACKWARD_IF_TRUE": True, "POP_JUMP_BACKWARD_IF_FALSE": False,
}
_JUMPS_KEEPING_VALUE = {"JUMP_IF_TRUE_OR_POP": True, "JUMP_IF_FALSE_OR_POP": False}
# how many values a breaking instruction leaves on the stack, where a resume can take them
_PUSHES = {"CALL": 1, "CALL_KW": 1, "CALL_FUNCTION_EX": 1, "BINARY_OP": 1, "COMPARE_OP": 1, "BINARY_SUBSCR": 1,
           "UNARY_NOT": 1, "TO_BOOL": 1, "STORE_ATTR": 0, "STORE_SUBSCR": 0, "STORE_GLOBAL": 0}
_STATEMENTS = {"CALL", "CALL_KW", "CALL_FUNCTION_EX", "STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "BINARY_OP",
               "COMPARE_OP", "BINARY_SUBSCR", "UNARY_NOT", "TO_BOOL", "LOAD_ATTR", "LOAD_METHOD", "RAISE_VARARGS"}
BREAKABLE = set(_JUMPS_ON_TRUTH) | set(_JUMPS_KEEPING_VALUE) | _STATEMENTS


def can_break_at(code: types.CodeType, inst: dis.Instruction) -> bool:
    return inst.opname in BREAKABLE and not (inst.opname == "RAISE_VARARGS" and inst.arg == 0)  # bare raise


# handlers that only pass an exception on: a `with` block's cleanup (it calls __exit__, then
# re-raises) and the cleanup that restores the exception state and re-raises
_PASSING_HANDLERS = (("PUSH_EXC_INFO", "WITH_EXCEPT_START"), ("COPY", "POP_EXCEPT"))


def inside_try(code: types.CodeType, offset: int) -> bool:
    """Whether an exception at `offset` would reach a handler of the user's (an `except` or
    `finally`), past any `with` block's cleanup: the native instruction would raise outside
    that handler. Each offset has one innermost handler; one that passes the exception on is
    followed to the handler covering its own code."""
    instructions, entries = _handler_tables(code)
    seen = set()
    while offset not in seen:
        seen.add(offset)
        entry = next((e for e in entries if e.start <= offset < e.end), None)
        if entry is None:
            return False
        handler = tuple(getattr(instructions.get(entry.target + 2 * k), "opname", "") for k in range(2))
        if handler not in _PASSING_HANDLERS:
            return True
        offset = entry.target
    return False


@functools.lru_cache(maxsize=64)
def _handler_tables(code: types.CodeType) -> tuple[dict, list]:
    """`code`'s instructions by offset and its exception table, read once per code object
    (eager_rerun asks `inside_try` of every instruction of a frame)."""
    instructions = {inst.offset: inst for inst in dis.get_instructions(code)}
    return instructions, getattr(dis, "_parse_exception_table", lambda c: [])(code)


class BreakCodegen:
    """Writes the statements of one break entry, after `___out = ___graph(...)`."""

    def __init__(self, tx: "Translator", fn: types.FunctionType, settings: "CompileSettings", rebuild: Reconstructor):
        self.tx = tx
        self.fn = fn
        self.settings = settings
        self.rebuild = rebuild
        self.inst = tx.instructions[tx.ip]
        self.lines: list[str] = []

    # -- the whole break ------------------------------------------------------------
    def generate(self) -> list[str]:
        """Statements to append after the graph call (rebuild.lines go before them)."""
        inst, tx = self.inst, self.tx
        if inside_try(tx.code, inst.offset):
            return self._native_rest()
        n_inputs = self._input_count()
        inputs = tx.stack[len(tx.stack) - n_inputs:]
        below = self._slots(tx.stack[: len(tx.stack) - n_inputs])
        locals_now = self._locals()
        if inst.opname in _JUMPS_ON_TRUTH or inst.opname in _JUMPS_KEEPING_VALUE:
            return self._branch(inputs[0], below, locals_now)
        if inst.opname == "RAISE_VARARGS":  # the graph and the side effects before it ran: raise natively
            exception = self.rebuild.expr(inputs[0])
            cause = f" from {self.rebuild.expr(inputs[1])}" if inst.arg == 2 else ""
            return self.lines + [f"raise {exception}{cause}"]
        outputs = self._statement(inputs)
        return self.lines + [f"return {self._resume_call(tx.ip + 1, below + outputs, locals_now)}"]

    def _native_rest(self) -> list[str]:
        """Inside a `try`, an exception of the breaking instruction must reach the user's
        handler: the resume function starts at the instruction itself, natively (not
        captured), and hands over to a compiled resume function right after it (see
        `_handoff`). Callees on the stack go through their compiled wrappers."""
        tx, index = self.tx, self.tx.ip
        while index > 0 and tx.instructions[index - 1].opname in ("PRECALL", "KW_NAMES"):
            index -= 1  # CALL needs the KW_NAMES (and PRECALL) before it
        stack = [self._compiled_callee(v) for v in tx.stack]
        slots = self._slots(stack)
        locals_now = self._locals()
        handoff = self._handoff(slots, locals_now)
        call = self._resume_call(index, slots, locals_now, compiled=False, handoff=handoff)
        return self.lines + [f"return {call}"]

    def _handoff(self, slots: list[tuple[str, str | None]], locals_now: dict[str, str]) -> Handoff | None:
        """After the breaking instruction, the rest of the frame in a compiled resume function
        (re-entering the `try` there), called from outside the native one's `try`s; None (the
        rest runs natively) where the stack below the instruction's inputs holds more than
        values and loops' iterators (a NULL of a call in progress), or the instruction pushes
        what a resume cannot take (a method and its NULL)."""
        inst, tx = self.inst, self.tx
        below = tuple(kind for kind, _ in slots[: len(slots) - self._input_count()])
        if NULL_SLOT in below:
            return None
        names = tuple(locals_now)
        if inst.opname in _JUMPS_ON_TRUTH and "BACKWARD" not in inst.opname:
            return Handoff(tx.ip, self._continuation(tx.ip + 1, below, names),
                           self._continuation(tx.index_of_offset[inst.argval], below, names))
        pushed = _PUSHES.get(inst.opname)
        if pushed is None:
            return None
        return Handoff(tx.ip, self._continuation(tx.ip + 1, below + (VALUE,) * pushed, names))

    def _continuation(self, index: int, layout: tuple[str, ...], names: tuple[str, ...]) -> Continuation:
        return Continuation(self._resume_function(index, layout, names, compiled=True), layout, names)

    def _compiled_callee(self, value: Value) -> Value:
        """A callable on the stack as Python source: user functions and modules as their
        compiled wrappers (see `_callable_expr`); any other value as it is."""
        text = self._callable_expr(value)
        return _Expr(text) if text is not None else value

    def _branch(self, condition: Value, below, locals_now) -> list[str]:
        inst, tx = self.inst, self.tx
        cond = self._temp("___cond", self.rebuild.expr(condition))
        target = tx.index_of_offset[inst.argval]
        keep = inst.opname in _JUMPS_KEEPING_VALUE
        jump_when = _JUMPS_KEEPING_VALUE[inst.opname] if keep else _JUMPS_ON_TRUTH[inst.opname]
        kept = [(VALUE, cond)] if keep else []
        jump = self._resume_call(target, below + kept, locals_now)
        fall = self._resume_call(tx.ip + 1, below, locals_now)
        test = cond if jump_when else f"not {cond}"
        return self.lines + [f"if {test}:", f"    return {jump}", f"return {fall}"]

    # -- stack and locals -------------------------------------------------------------
    def _temp(self, name: str, expr: str) -> str:
        self.lines.append(f"{name} = {expr}")
        return name

    def _slots(self, values: list[Value]) -> list[tuple[str, str | None]]:
        slots = []
        for i, value in enumerate(values):
            if isinstance(value, _Expr):
                slots.append((VALUE, self._temp(f"___s{i}", value.text)))
            elif isinstance(value, NullValue):
                slots.append((NULL_SLOT, None))
            elif isinstance(value, IteratorValue):
                items = ", ".join(self.rebuild.expr(v) for v in value.remaining)
                slots.append((ITERATOR, self._temp(f"___s{i}", f"[{items}]")))
            else:
                slots.append((VALUE, self._temp(f"___s{i}", self.rebuild.expr(value))))
        return slots

    def _locals(self) -> dict[str, str]:
        """Live locals, and the contents of live cells (the resume prologue re-makes the cells)."""
        tx = self.tx
        live = live_locals_at(tx.code, tx.ip)
        defined = set(tx.locals) | set(tx.pending_locals)
        exprs = {}
        for name in sorted(live):
            if name in tx.code.co_cellvars:
                cell = tx.cells.get(name)
                if isinstance(cell, CellValue) and cell.contents is not None:
                    exprs[name] = self._temp(_local_temp(name), self.rebuild.expr(cell.contents))
            elif name in tx.pending_locals:  # never read by the graph: the argument as it came
                exprs[name] = LocalSource(name).expr()
            elif name in defined:
                exprs[name] = self._temp(_local_temp(name), self.rebuild.expr(tx.locals[name]))
        return exprs

    def _resume_call(self, index: int, stack: list[tuple[str, str | None]], locals_now: dict[str, str],
                     compiled: bool = True, handoff: Handoff | None = None) -> str:
        names = tuple(locals_now)
        wrapper = self._resume_function(index, tuple(kind for kind, _ in stack), names, compiled, handoff)
        args = [expr for kind, expr in stack if kind != NULL_SLOT] + [locals_now[n] for n in names]
        return f"{self.rebuild.const(wrapper)}({', '.join(args)})"

    def _resume_function(self, index: int, layout: tuple[str, ...], names: tuple[str, ...], compiled: bool,
                         handoff: Handoff | None = None):
        """The function resuming the frame at instruction `index` with that stack and those locals:
        compiled (its own CompiledFunction), or native (a plain function)."""
        from torchweld.capture.compiled_function import CompiledFunction

        for _ in range(4):  # resume at the target of an unconditional jump: one resume point per place
            inst = self.tx.instructions[index]
            if inst.opname not in ("JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT"):
                break
            index = self.tx.index_of_offset[inst.argval]
        code = make_resume_code(self.tx.code, index, layout, names, handoff)

        loop_lists = tuple(f"___stack{i}" for i, kind in enumerate(layout) if kind == ITERATOR)

        def make():
            function = types.FunctionType(code, self.fn.__globals__, code.co_name, None, self.fn.__closure__)
            return CompiledFunction(function, self.settings, loop_lists=loop_lists) if compiled else function

        return self.settings.wrapper(("resume", code, compiled), make)

    # -- the instruction, natively ------------------------------------------------------
    def _input_count(self) -> int:
        inst = self.inst
        name = inst.opname
        if name == "CALL":
            return inst.arg + 2
        if name == "CALL_KW":
            return inst.arg + 3  # the keywords' names above the arguments
        if name == "CALL_FUNCTION_EX":
            return 3 + (inst.arg & 1)
        if name in ("STORE_SUBSCR",):
            return 3
        if name in ("STORE_ATTR", "BINARY_OP", "COMPARE_OP", "BINARY_SUBSCR"):
            return 2
        if name == "RAISE_VARARGS":
            return inst.arg
        return 1

    def _statement(self, inputs: list[Value]) -> list[tuple[str, str | None]]:
        """Emit the instruction as Python statements; return the slots it pushes."""
        inst, expr = self.inst, self.rebuild.expr
        name = inst.opname
        if name in ("CALL", "CALL_KW"):
            kw_names = inputs.pop().as_constant() if name == "CALL_KW" else (self.tx.kw_names or ())
            fn, args = callable_and_args(inputs[:2], inputs[2:])
            positional = args[: len(args) - len(kw_names)]
            keywords = dict(zip(kw_names, args[len(args) - len(kw_names):]))
            call = self._call(fn, [expr(a) for a in positional], [f"{k}={expr(v)}" for k, v in keywords.items()])
            return [(VALUE, self._temp("___r", call))]
        if name == "CALL_FUNCTION_EX":
            fn, bound = callable_and_args(inputs[:2], [])
            star_args, *star_kwargs = inputs[2:]
            if bound:
                raise Unsupported("a break at a *args call of a method")
            parts = [f"*{expr(star_args)}"] + ([f"**{expr(star_kwargs[0])}"] if star_kwargs else [])
            return [(VALUE, self._temp("___r", self._call(fn, parts, [])))]
        if name == "STORE_ATTR":
            obj, value = inputs[1], inputs[0]
            self.lines.append(f"setattr({expr(obj)}, {inst.argval!r}, {expr(value)})")
            return []
        if name == "STORE_SUBSCR":
            value, obj, key = inputs
            self.lines.append(f"{expr(obj)}[{expr(key)}] = {expr(value)}")
            return []
        if name == "STORE_GLOBAL":
            self.lines.append(f"___G[{inst.argval!r}] = {expr(inputs[0])}")
            return []
        if name == "BINARY_OP":
            symbol = dis._nb_ops[inst.arg][1]
            a, b = (expr(v) for v in inputs)
            if symbol.endswith("=") and symbol not in ("==",):
                self.lines += [f"___r = {a}", f"___r {symbol} {b}"]
            else:
                self.lines.append(f"___r = {a} {symbol} {b}")
            return [(VALUE, "___r")]
        if name == "COMPARE_OP":
            a, b = (expr(v) for v in inputs)
            compared = f"{a} {inst.argval} {b}"
            return [(VALUE, self._temp("___r", f"bool({compared})" if compare_makes_bool(inst) else compared))]
        if name == "TO_BOOL":
            return [(VALUE, self._temp("___r", f"bool({expr(inputs[0])})"))]
        if name == "BINARY_SUBSCR":
            a, b = (expr(v) for v in inputs)
            return [(VALUE, self._temp("___r", f"{a}[{b}]"))]
        if name == "UNARY_NOT":
            return [(VALUE, self._temp("___r", f"not {expr(inputs[0])}"))]
        if name in ("LOAD_ATTR", "LOAD_METHOD"):
            result = self._temp("___r", f"getattr({expr(inputs[0])}, {inst.argval!r})")
            method_form = name == "LOAD_METHOD" or (sys.version_info >= (3, 12) and inst.arg & 1)
            if not method_form:
                return [(VALUE, result)]
            null = [(NULL_SLOT, None)]
            return [(VALUE, result)] + null if CALLABLE_BELOW_NULL else null + [(VALUE, result)]
        raise Unsupported(f"cannot break the graph at {name}")

    def _call(self, fn: Value, args: list[str], kwargs: list[str]) -> str:
        """A call of `fn`; user functions go through their own compiled wrapper."""
        target = self._callable_expr(fn) or self.rebuild.expr(fn)
        return f"{target}({', '.join(args + kwargs)})"

    def _callable_expr(self, fn: Value) -> str | None:
        """Python source for a callable that has no source of its own to reload from:
        a user function, method or module (through its compiled wrapper, so that it is
        captured in its own graphs) or a method of a tensor, container or constant."""
        expr = self.rebuild.expr
        bind = lambda function, owner: f"{self.rebuild.const(types.MethodType)}({self._wrapper(function)}, {expr(owner)})"  # noqa: E731
        if isinstance(fn, UserFunctionValue):
            return self._wrapper(fn.fn)
        if isinstance(fn, BoundMethodValue) and isinstance(fn.func, UserFunctionValue):
            return bind(fn.func.fn, fn.self_value)
        if isinstance(fn, NNModuleValue) and is_ddp(fn.module):
            if _has_hooks(fn.module) or "forward" in fn.module.__dict__:
                return None  # called as `ddp(...)`, eagerly: its hooks run around its forward
            guard_plain_call(self.tx, fn.module, fn.source)
            return f"{self.rebuild.const(types.MethodType)}({self.rebuild.const(ddp_forward(self.settings))}, {expr(fn)})"
        if isinstance(fn, NNModuleValue) and is_fsdp_managed(fn.module) and "forward" not in fn.module.__dict__:
            call = self._native_hooks_call(type(fn.module).forward)
            return f"{self.rebuild.const(types.MethodType)}({call}, {expr(fn)})"
        if isinstance(fn, NNModuleValue) and not is_standard_module(fn.module):
            if _has_hooks(fn.module) or "forward" in fn.module.__dict__:
                return None  # called as `module(...)`: its hooks run around its forward, as in eager
            guard_plain_call(self.tx, fn.module, fn.source)  # hooks added later make this entry a miss
            return bind(type(fn.module).forward, fn)
        if isinstance(fn, (TensorMethodValue, ContainerMethodValue)):
            owner = fn.tensor if isinstance(fn, TensorMethodValue) else fn.container
            return f"{expr(owner)}.{fn.name}"
        if isinstance(fn, ConstantMethodValue):
            return f"{self.rebuild.const(fn.obj)}.{fn.name}"
        return None

    def _native_hooks_call(self, function: types.FunctionType) -> str:
        """A call of a module whose hooks run natively around `function`, its compiled forward."""
        call = self.settings.wrapper(("native hooks", function), lambda: NativeHooksCall(function, self.settings))
        return self.rebuild.const(call)

    def _wrapper(self, function: types.FunctionType) -> str:
        from torchweld.capture.compiled_function import CompiledFunction

        wrapper = self.settings.wrapper(("callee", function), lambda: CompiledFunction(function, self.settings))
        return self.rebuild.const(wrapper)


def _local_temp(name: str) -> str:
    """The temporary holding local `name` (pytest's rewritten asserts name locals `@py_assert1`)."""
    return f"___l_{name}" if name.isidentifier() else f"___l_{name.encode().hex()}"


class _Expr(Value):
    """A stack slot already written as Python source (a compiled callee)."""

    def __init__(self, text: str):
        self.text = text
