"""Shrink a failing case while it keeps failing the same way (the same kind of difference,
and for raised errors the same exception types; or killing its process): drop calls and state changes, then
statements of `f`, then the module's setup statements, returned values and keyword
arguments, until no single removal keeps the failure."""
from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from tests.fuzz.case import Call, Case
from tests.fuzz.driver import GeneratorError, Outcome, run_case

ROOT = Path(__file__).resolve().parents[2]


def failure_key(outcome: Outcome) -> str | None:
    if not outcome.differences:
        return None
    first = outcome.differences[0]
    if first.what in ("raised", "internal"):
        return first.key.split(" at ")[0]  # exception types; where in torchweld may move
    return first.what


def same_failure_here(case: Case) -> Callable[[Case], bool]:
    """A test for candidates, run in this process: they fail as `case` does."""
    target = failure_key(run_case(case))
    if target is None:
        raise ValueError("the case does not fail")

    def fails(candidate: Case) -> bool:
        try:
            return failure_key(run_case(candidate)) == target
        except GeneratorError:
            return False
    return fails


def crashes_in_subprocess(timeout_s: float = 120.0) -> Callable[[Case], bool]:
    """A test for candidates that kill their process (a segfault in the compiler): each
    runs in a fresh interpreter (`python -m tests.fuzz.run --case-json FILE`)."""
    def fails(candidate: Case) -> bool:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(candidate.to_json())
        try:
            done = subprocess.run([sys.executable, "-m", "tests.fuzz.run", "--case-json", f.name],
                                  cwd=ROOT, capture_output=True, timeout=timeout_s)
            return done.returncode < 0  # killed by a signal
        except subprocess.TimeoutExpired:
            return False
        finally:
            os.unlink(f.name)
    return fails


def minimize(case: Case, fails: Callable[[Case], bool], budget_s: float = 600.0,
             log: Callable[[str], None] = lambda s: None) -> Case:
    deadline = time.monotonic() + budget_s
    runs = 0
    position, since_success = 0, 0  # after a removal, go on from where it was (not from the start)
    while time.monotonic() < deadline:
        candidates = list(_candidates(case))
        if not candidates or since_success >= len(candidates):
            break  # a whole round of candidates without a success
        position %= len(candidates)
        if candidates[position] == case:  # a removal that changes nothing (`pass` for `pass`)
            position, since_success = position + 1, since_success + 1
            continue
        runs += 1
        if fails(candidates[position]):
            case, since_success = candidates[position], 0
            log(f"  {runs} runs: {len(case.calls)} calls, {len(case.source.splitlines())} lines")
        else:
            position, since_success = position + 1, since_success + 1
    source = re.sub(r"\n{4,}", "\n\n\n", case.source)
    return dataclasses.replace(case, source=source, origin=case.origin + " (minimized)")


def _candidates(case: Case) -> Iterator[Case]:
    calls = list(case.calls)
    for n in range(1, len(calls)):  # fewer calls, the later ones first to go
        yield dataclasses.replace(case, calls=tuple(calls[:n]))
    for i in range(len(calls)):
        if len(calls) > 1:
            yield dataclasses.replace(case, calls=tuple(calls[:i] + calls[i + 1:]))
    for i, call in enumerate(calls):
        for simpler in _simpler_calls(call):
            yield dataclasses.replace(case, calls=tuple(calls[:i] + [simpler] + calls[i + 1:]))
    for source in _simpler_sources(case.source):
        yield dataclasses.replace(case, source=source)


def _simpler_calls(call: Call) -> Iterator[Call]:
    lines = call.changes.splitlines()
    for i in range(len(lines)):
        yield dataclasses.replace(call, changes="\n".join(lines[:i] + lines[i + 1:]))
    if call.grad_mode != "enabled":
        yield dataclasses.replace(call, grad_mode="enabled")
    if call.default_dtype != "float32":
        yield dataclasses.replace(call, default_dtype="float32")
    for plainer, pattern in (("", r"\.requires_grad_\(\)"), ("", r", dtype=torch\.float64"),
                             ("R = 3", r"^R = [25]$"), ("y = torch.randn(R, 4)", r"^y = x\b.*$"),
                             ("y = torch.randn(4)", r"^y = x\[.*$")):
        args = re.sub(pattern, plainer, call.args, flags=re.M)
        if args != call.args:
            yield dataclasses.replace(call, args=args)
    for args in _without_list_items(call.args):
        yield dataclasses.replace(call, args=args)
    kwargs = re.search(r"^kwargs = \{(.+)\}$", call.args, re.M)
    if kwargs:
        items = [item.strip() for item in kwargs.group(1).split(", ")]
        for i in range(len(items)):
            rest = ", ".join(items[:i] + items[i + 1:])
            yield dataclasses.replace(call, args=call.args.replace(kwargs.group(0), f"kwargs = {{{rest}}}"))


def _without_list_items(source: str) -> Iterator[str]:
    """The arguments' source with one item of one list literal left out."""
    tree = ast.parse(source)
    lists = [node for node in ast.walk(tree) if isinstance(node, ast.List)]
    for n, node in enumerate(lists):
        for i in range(len(node.elts)):
            copy = ast.parse(source)
            target = [m for m in ast.walk(copy) if isinstance(m, ast.List)][n]
            del target.elts[i]
            yield ast.unparse(copy)


def _simpler_sources(source: str) -> Iterator[str]:
    lines = source.splitlines()
    tree = ast.parse(source)
    f = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "f")
    blocks = list({id(b): b for node in ast.walk(f) for b in _blocks(node)}.values())  # outer blocks first
    for block in blocks:  # one statement left out (`pass` where it was alone), the last first
        for stmt in reversed(block):
            if isinstance(stmt, ast.Return) and block is f.body or isinstance(stmt, ast.Pass):
                continue
            if len(block) == 1:
                yield _replace_lines(lines, stmt.lineno, stmt.end_lineno, [" " * stmt.col_offset + "pass"])
            else:
                yield _replace_lines(lines, stmt.lineno, stmt.end_lineno, [])
    for block in blocks:  # a compound statement replaced by one of its blocks
        for stmt in block:
            for inner in _blocks(stmt):
                body = lines[inner[0].lineno - 1:inner[-1].end_lineno]
                shift = inner[0].col_offset - stmt.col_offset
                yield _replace_lines(lines, stmt.lineno, stmt.end_lineno, [line[shift:] for line in body])
    returned = f.body[-1]
    if isinstance(returned, ast.Return) and isinstance(returned.value, (ast.Tuple, ast.List, ast.Dict)):
        items = returned.value.elts if not isinstance(returned.value, ast.Dict) else returned.value.values
        for i in range(len(items)):
            rest = [ast.unparse(item) for j, item in enumerate(items) if j != i]
            yield _replace_lines(lines, returned.lineno, returned.end_lineno,
                                 ["    return " + ", ".join(rest) + ("," if len(rest) == 1 else "")])
    for stmt in reversed(tree.body):  # the module's setup, after the function
        if stmt is not f:
            yield _replace_lines(lines, stmt.lineno, stmt.end_lineno, [])


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    """The statement blocks directly inside a node (a function's body, an if's two arms,
    a try's body, handlers, else and finally)."""
    blocks = [getattr(node, name) for name in ("body", "orelse", "finalbody")
              if isinstance(getattr(node, name, None), list) and getattr(node, name)
              and isinstance(getattr(node, name)[0], ast.stmt)]
    return blocks + [handler.body for handler in getattr(node, "handlers", [])]


def _replace_lines(lines: list[str], first: int, last: int, new: list[str]) -> str:
    return "\n".join(lines[:first - 1] + new + lines[last:]) + "\n"
