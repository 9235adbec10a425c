"""Resume functions: a new code object that continues a function after a graph
break. Its arguments are the values that were on the stack and the live locals;
a short prologue puts the stack back and jumps into a copy of the original code.

    def torchweld_resume_in_f_at_12(___stack0, ___stack1, x, y):
        <push ___stack0, ___stack1>          # NULL slots are PUSH_NULL
        jump to the instruction after the break
        ... the rest of f, unchanged ...
"""
from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import sys
import types
import weakref

from bytecode import Bytecode, CellVar, Instr, Label, TryBegin

from torchweld.errors import Unsupported

# a stack slot at the break: an ordinary value, CPython's NULL, or a list that the
# prologue turns back into an iterator for a `for` loop in progress
VALUE, NULL_SLOT, ITERATOR = "value", "null", "iterator"


def instruction_index_in_bytecode(code: types.CodeType, dis_index: int) -> int:
    """Position among `bytecode.Instr`s of the `dis_index`-th instruction of `dis`."""
    instructions = list(dis.get_instructions(code))
    return sum(1 for inst in instructions[:dis_index] if inst.opname != "EXTENDED_ARG")


# resume code -> (the original code, resume dis index -> original dis index), so that
# a break inside a resume function resumes the original code again (no chains of copies)
_ORIGINS: "weakref.WeakKeyDictionary[types.CodeType, tuple[types.CodeType, dict[int, int]]]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Continuation:
    """Where a resume function that runs one instruction natively hands over: it calls `fn` with
    the values on the stack there (`layout`: VALUE or ITERATOR each, an iterator passed as the
    list of its remaining items) and the locals in `names`, and returns its result."""
    fn: object
    layout: tuple[str, ...]
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Handoff:
    """After the `at`-th instruction (dis index), the resume function calls `fallthrough`; where
    that instruction is a jump, `jumped` where it jumps. The call sits outside every `try`: an
    exception the continuation lets out is not caught a second time."""
    at: int
    fallthrough: Continuation
    jumped: Continuation | None = None


def make_resume_code(code: types.CodeType, dis_index: int, stack_layout: tuple[str, ...],
                     live_locals: tuple[str, ...], handoff: Handoff | None = None) -> types.CodeType:
    """A code object that resumes `code` at its `dis_index`-th instruction (and with `handoff`,
    hands over after one instruction)."""
    if code in _ORIGINS:
        original, index_map = _ORIGINS[code]
        instructions = list(dis.get_instructions(code))
        while instructions[dis_index].opname == "EXTENDED_ARG":  # a jump's target: the instruction it prefixes
            dis_index += 1
        code, dis_index = original, index_map[dis_index]
        live_locals = tuple(_original_name(name) for name in live_locals)
        if handoff is not None:
            handoff = dataclasses.replace(handoff, at=index_map[handoff.at])
    if handoff is not None:  # its code holds a compiled model's continuation: not in the process-wide cache
        return _make_resume_code.__wrapped__(code, dis_index, stack_layout, live_locals, handoff)
    return _make_resume_code(code, dis_index, stack_layout, live_locals)


def forget() -> None:
    """Drop the resume code made so far (torchweld.reset)."""
    _make_resume_code.cache_clear()


@functools.lru_cache(maxsize=256)
def _make_resume_code(code: types.CodeType, dis_index: int, stack_layout: tuple[str, ...],
                      live_locals: tuple[str, ...], handoff: Handoff | None = None) -> types.CodeType:
    original = Bytecode.from_code(code)
    target_position = instruction_index_in_bytecode(code, dis_index)
    handoff_position = instruction_index_in_bytecode(code, handoff.at) if handoff is not None else None
    stubs: list = []
    target = Label()
    body: list = []
    offsets = [inst.offset for inst in dis.get_instructions(code) if inst.opname != "EXTENDED_ARG"]
    label_offsets: dict[Label, int] = {}  # each label of the copy: the original offset it marks
    unplaced: list[Label] = []
    seen = 0
    for item in original:
        if isinstance(item, Label):
            unplaced.append(item)
        if isinstance(item, Instr):
            label_offsets.update((label, offsets[seen]) for label in unplaced)
            unplaced.clear()
            if seen == target_position:
                body.append(target)
            if seen == handoff_position:
                _hand_over(item, handoff, body, stubs, code.co_cellvars, live_locals)
                seen += 1
                continue
            seen += 1
            if item.name in ("RESUME", "MAKE_CELL", "COPY_FREE_VARS"):
                item = Instr("NOP", location=item.location)
        body.append(item)
    body += stubs  # after every TryEnd: outside the `try`s
    _keep_handler_depths(code, body, label_offsets)
    if target not in body:  # resuming at the very end cannot happen: the last instruction returns
        raise ValueError(f"no instruction {dis_index} in {code.co_name}")

    stack_args = [f"___stack{i}" for i, kind in enumerate(stack_layout) if kind != NULL_SLOT]
    # cells get fresh cell objects holding the values passed in: the inner functions that
    # shared the old cells are gone (capture cannot rebuild a live nested function)
    prologue = [Instr("MAKE_CELL", CellVar(name)) for name in code.co_cellvars]
    if code.co_freevars:
        prologue.append(Instr("COPY_FREE_VARS", len(code.co_freevars)))
    prologue.append(Instr("RESUME", 0))
    for i, kind in enumerate(stack_layout):
        if kind == NULL_SLOT:
            prologue.append(Instr("PUSH_NULL"))
        else:
            prologue.append(Instr("LOAD_FAST", f"___stack{i}"))
            if kind == ITERATOR:
                prologue.append(Instr("GET_ITER"))
    prologue.append(Instr("JUMP_FORWARD", target))

    resumed = Bytecode(prologue + _renamed_locals(body, live_locals))
    resumed.argnames = stack_args + [_parameter_name(name) for name in live_locals]
    resumed.argcount = len(resumed.argnames)
    resumed.posonlyargcount = 0
    resumed.kwonlyargcount = 0
    resumed.flags = code.co_flags & ~(inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    resumed.name = f"torchweld_resume_in_{code.co_name}_at_{_line_of(code, dis_index)}"
    resumed.qualname = resumed.name
    resumed.filename = code.co_filename
    resumed.first_lineno = code.co_firstlineno
    resumed.docstring = None
    resumed.freevars = list(code.co_freevars)
    resumed.cellvars = list(code.co_cellvars)
    # Every instruction of the copy runs on the stack the original had there (the prologue
    # rebuilds the stack at the resume point; handlers are entered at the original's depths),
    # so the original's depth bounds the copy's, with room for the hand-over stubs' calls.
    # Too small a depth lets pushes run over into the next frame's memory.
    bound = code.co_stacksize
    for go in ([handoff.fallthrough, handoff.jumped] if handoff is not None else []):
        if go is not None:
            bound = max(bound, len(go.layout) + len(go.names) + 4)  # callee, NULL, arguments, list()
    try:
        new_code = resumed.to_code(compute_exception_stack_depths=False)
    except RuntimeError:  # the library's walk from the prologue's jump into the middle of a `try`
        # (a `with` block that always raises, a `raise` or `finally` in a loop) finds a handler's
        # stack below zero; the bound above needs no walk
        try:
            new_code = resumed.to_code(stacksize=bound, compute_exception_stack_depths=False)
        except RuntimeError as e:
            raise Unsupported(f"cannot resume {code.co_name} after the break ({e})") from None
    new_code = new_code.replace(co_stacksize=max(new_code.co_stacksize, bound))
    real = [i for i, inst in enumerate(dis.get_instructions(new_code)) if inst.opname != "EXTENDED_ARG"]
    originals = [i for i, inst in enumerate(dis.get_instructions(code)) if inst.opname != "EXTENDED_ARG"]
    body_start = len(prologue)
    _ORIGINS[new_code] = (code, {real[body_start + k]: originals[k] for k in range(len(originals))})
    return new_code


def _hand_over(inst: Instr, handoff: Handoff, body: list, stubs: list, cellvars: tuple[str, ...],
               parameters: tuple[str, ...]) -> None:
    """Append `inst` to `body`, then a jump to a stub (appended to `stubs`) that calls the
    fall-through continuation; a jump instruction jumps to a stub of `handoff.jumped` instead."""
    if handoff.jumped is not None:
        inst = inst.copy()
        inst.arg = _stub(handoff.jumped, stubs, cellvars, parameters, inst.location)
    body.append(inst)
    body.append(Instr("JUMP_FORWARD", _stub(handoff.fallthrough, stubs, cellvars, parameters, inst.location),
                      location=inst.location))


def _stub(go: Continuation, stubs: list, cellvars: tuple[str, ...], parameters: tuple[str, ...], location) -> Label:
    """Code that calls `go.fn(*stack, *locals)` and returns what it returns; its label. A
    loop's iterator goes as `list(iterator)`: the items it has left, which the continuation's
    prologue iterates again."""
    label = Label()
    held = [f"___handoff{i}" for i in range(len(go.layout))]
    args: list = []
    for name, kind in zip(held, go.layout):
        args += _call(list, [Instr("LOAD_FAST", name)]) if kind == ITERATOR else [Instr("LOAD_FAST", name)]
    for name in go.names:
        args.append(Instr("LOAD_DEREF", CellVar(name)) if name in cellvars
                    else Instr("LOAD_FAST", _parameter_name(name) if name in parameters else name))
    code: list = [label] + [Instr("STORE_FAST", name) for name in reversed(held)]
    code += _call(go.fn, args, len(held) + len(go.names)) + [Instr("RETURN_VALUE")]
    for inst in code:
        if isinstance(inst, Instr):
            inst.location = location
    stubs += code
    return label


def _call(fn: object, args: list, n: int = 1) -> list:
    """Instructions calling the constant `fn` with the `n` values `args` push."""
    callee = [Instr("LOAD_CONST", fn), Instr("PUSH_NULL")] if sys.version_info >= (3, 13) else \
        [Instr("PUSH_NULL"), Instr("LOAD_CONST", fn)]
    call = [Instr("PRECALL", n), Instr("CALL", n)] if sys.version_info < (3, 12) else [Instr("CALL", n)]
    return callee + args + call


def _parameter_name(name: str) -> str:
    """A local's name as a parameter may spell it (pytest's rewritten asserts use `@py_assert1`)."""
    return name if name.isidentifier() else f"___local_{name.encode().hex()}"


def _original_name(name: str) -> str:
    """The local's own name, where `_parameter_name` renamed it."""
    return bytes.fromhex(name[len("___local_"):]).decode() if name.startswith("___local_") else name


def _renamed_locals(body: list, names: tuple[str, ...]) -> list:
    """`body` with the locals in `names` that are no identifiers renamed as parameters spell them."""
    renamed = {n: _parameter_name(n) for n in names if not n.isidentifier()}
    if not renamed:
        return body
    out = []
    for item in body:
        if isinstance(item, Instr) and "FAST" in item.name:
            arg = item.arg
            new = tuple(renamed.get(a, a) for a in arg) if isinstance(arg, tuple) else renamed.get(arg, arg)
            if new != arg:
                item = item.copy()
                item.arg = new
        out.append(item)
    return out


def _keep_handler_depths(code: types.CodeType, body: list, label_offsets: dict) -> None:
    """Give each try region of the copy its handler's stack depth in the original. The prologue
    rebuilds the stack the original had at the break, so those depths hold; computed from the
    resume's entry instead, a region the prologue jumps into the middle of is never reached
    from its start, and its handler would unwind the stack to a depth nobody set."""
    depth_of_handler = {entry.target: entry.depth for entry in _exception_entries(code)}
    for item in body:
        if isinstance(item, TryBegin):
            item.stack_depth = depth_of_handler[label_offsets[item.target]]


def _line_of(code: types.CodeType, dis_index: int) -> int:
    line = code.co_firstlineno
    for i, inst in enumerate(dis.get_instructions(code)):
        if inst.positions is not None and inst.positions.lineno is not None:
            line = inst.positions.lineno
        if i == dis_index:
            return line
    return line


def live_locals_at(code: types.CodeType, dis_index: int) -> set[str]:
    """Locals that some instruction reachable from `dis_index` may read (conservative:
    a store before the read does not make a local dead)."""
    instructions = list(dis.get_instructions(code))
    index_of = {inst.offset: i for i, inst in enumerate(instructions)}
    starts = [dis_index] + [index_of[e.target] for e in _exception_entries(code) if e.target in index_of]
    seen: set[int] = set()
    todo = list(starts)
    live: set[str] = set()
    while todo:
        i = todo.pop()
        if i in seen or i >= len(instructions):
            continue
        seen.add(i)
        inst = instructions[i]
        if inst.opname.startswith(("LOAD_FAST", "DELETE_FAST")) or inst.opname in ("LOAD_CLOSURE", "LOAD_DEREF"):
            live.update(inst.argval if isinstance(inst.argval, tuple) else (inst.argval,))  # LOAD_FAST_LOAD_FAST
        elif inst.opname == "STORE_FAST_LOAD_FAST":  # 3.13: stores its first name, then reads its second
            live.add(inst.argval[1])
        if inst.opcode in dis.hasjabs or inst.opcode in dis.hasjrel:
            todo.append(index_of[inst.argval])
        if inst.opname not in _NO_FALLTHROUGH:
            todo.append(i + 1)
    return live


_NO_FALLTHROUGH = {"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "JUMP_FORWARD", "JUMP_BACKWARD",
                   "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE"}


def _exception_entries(code: types.CodeType) -> list:
    parse = getattr(dis, "_parse_exception_table", None)
    return parse(code) if parse is not None else []
