"""One generated test case as plain source text (the program's module and, per call, the
state changes and the arguments), and its renderings: a report and a standalone script."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import textwrap

# How a call's grad mode is set (the driver enters it around the state changes, the
# arguments and the call, for eager and compiled alike).
GRAD_MODES = {
    "enabled": "contextlib.nullcontext()",
    "no_grad": "torch.no_grad()",
    "set_grad_enabled(False)": "torch.set_grad_enabled(False)",
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of the program. `changes` runs in the program's module first (the driver
    changing globals, attributes, defaults, modules, hooks); `args` binds `args` and
    `kwargs` in a copy of the module's namespace. Each runs after torch.manual_seed."""

    args: str
    changes: str = ""
    default_dtype: str = "float32"
    grad_mode: str = "enabled"
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Case:
    source: str  # the program's module: imports, globals, classes, helpers, `def f`
    calls: tuple[Call, ...]
    backend: str = "eager"
    target: str = "f"  # the name in the module that is compiled and called
    features: tuple[str, ...] = ()  # the grammar's tags this program used
    origin: str = ""  # how to generate it again ("--seed 0 --index 7", "hypothesis")
    dynamic: bool | None = None  # torchweld.compile's dynamic= (None: automatic, as by default)

    @property
    def key(self) -> str:
        return hashlib.sha1(self.to_json().encode()).hexdigest()[:12]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "Case":
        fields = json.loads(text)
        fields["calls"] = tuple(Call(**c) for c in fields["calls"])
        fields["features"] = tuple(fields["features"])
        return Case(**fields)

    def describe_calls(self) -> str:
        lines = []
        for i, call in enumerate(self.calls):
            lines.append(f"--- call {i}: default dtype {call.default_dtype}, grad mode {call.grad_mode}, "
                         f"seed {call.seed}")
            if call.changes:
                lines.append("    # state changes before the call:")
                lines.append(textwrap.indent(call.changes, "    "))
            lines.append(textwrap.indent(call.args, "    "))
        return "\n".join(lines)

    def report(self) -> str:
        numbered = "\n".join(f"{i + 1:3} {line}" for i, line in enumerate(self.source.splitlines()))
        return (f"backend={self.backend!r} target={self.target!r} dynamic={self.dynamic!r} {self.origin}\n"
                f"features: {', '.join(self.features)}\n"
                f"=== program ===\n{numbered}\n=== calls ===\n{self.describe_calls()}\n")

    def script(self) -> str:
        """A standalone Python script (torch, numpy and torchweld only) that runs the
        program eagerly and compiled, call by call, and prints both sides."""
        calls = ",\n".join(
            f"    dict(seed={c.seed}, dtype=torch.{c.default_dtype}, grad=lambda: {GRAD_MODES[c.grad_mode]},\n"
            f"         changes={c.changes!r},\n         args={c.args!r})" for c in self.calls)
        return SCRIPT.format(backend=self.backend, target=self.target, origin=self.origin, dynamic=self.dynamic,
                             source=self.source.replace("\\", "\\\\").replace("'''", "\\'\\'\\'"), calls=calls)


SCRIPT = '''"""Reproducer written by torchweld's differential fuzzer ({origin}): the program runs
eagerly and compiled (backend={backend!r}); each call prints what both sides returned,
raised, printed and left in their arguments."""
import contextlib
import io
import types

import torch

import torchweld

torchweld.config.raise_internal_errors = True  # as in the test suite (users get an eager fallback)

SOURCE = \'\'\'{source}\'\'\'


def load():
    module = types.ModuleType("fuzz_program")
    torch.manual_seed(0)
    exec(compile(SOURCE, "<fuzz program>", "exec"), module.__dict__)
    return module


CALLS = [
{calls},
]

eager, compiled = load(), load()
sides = [("eager", eager, getattr(eager, {target!r})),
         ("compiled", compiled, torchweld.compile(getattr(compiled, {target!r}), backend={backend!r}, dynamic={dynamic!r}))]
for i, call in enumerate(CALLS):
    for name, module, fn in sides:
        dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
        torch.set_default_dtype(call["dtype"])
        try:
            with call["grad"]():
                torch.manual_seed(call["seed"])
                exec(call["changes"], module.__dict__)
                torch.manual_seed(call["seed"] + 1)
                scope = dict(module.__dict__)
                exec(call["args"], scope)
                args, kwargs = scope["args"], scope["kwargs"]
                torch.manual_seed(call["seed"] + 2)
                text = io.StringIO()
                with contextlib.redirect_stdout(text):
                    try:
                        out = fn(*args, **kwargs)
                    except Exception as e:
                        out = e
        finally:
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(grad)
        print(f"call {{i}} {{name}}: returned {{out!r}}")
        print(f"    printed {{text.getvalue()!r}}")
        print(f"    args after {{args!r}} {{kwargs!r}}")
'''
