"""Generate one test case: a program's module source (the setup sections a program uses,
then `def f` written from the statement templates in statements.py) and its calls, with
the state changes the driver makes between them."""
from __future__ import annotations

import itertools
import random
import textwrap

from tests.fuzz.case import GRAD_MODES, Call, Case
from tests.fuzz.draw import Draw, RandomDraw
from tests.fuzz.statements import TEMPLATES

HEADER = """\
import collections
import functools
import heapq
import math
import operator
import types

import numpy as np
import torch
"""

# Program-level features: each is a setup section of the module, readable names it
# adds (expression -> kind), and the chance a program has it.
SETUP = {
    "globals": ("""\
G_N = 2
G_F = 0.5
G_T = torch.linspace(-1.0, 1.0, 4)
G_L = [3, 1, 2]
G_LAST = None
""", {"G_N": "int", "G_F": "float", "G_T": "V", "G_L": "nlist"}, 0.4),
    "object": ("""\
class Cfg:
    def __init__(self):
        self.scale = 1.5
        self.k = 2
        self.t = torch.ones(4)
        self.hist = []

    @property
    def double(self):
        return self.scale * 2

    def scaled(self, z):
        return z * self.scale + self.k


OBJ = Cfg()
""", {"OBJ.scale": "float", "OBJ.k": "int", "OBJ.t": "V", "OBJ.hist": "nlist"}, 0.35),
    "pymodule": ("""\
cfgmod = types.ModuleType("fuzz_cfg")
cfgmod.k = 3
cfgmod.scale = 0.25
cfgmod.count = 0
""", {"cfgmod.k": "int", "cfgmod.scale": "float"}, 0.25),
    "helper": ("""\
def helper(z, a=1.0, *, b=2):
    return z * a + b


def noisy(z, scale=1.0):
    print("noisy", z.dim())
    return z * scale + 1


def push(items, v):
    items.append(v)
    return len(items)
""", {}, 0.35),
    "scale_closure": ("""\
def make_scale(c):
    def scale(z):
        return z * c
    return scale


SCALE = make_scale(2.0)
""", {}, 0.25),
    "numpy_global": ("NP_G = np.linspace(-1.0, 1.0, 4)\n", {"NP_G": "npV"}, 0.2),
    "nn_module": ("""\
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.register_buffer("steps", torch.zeros(()))
        self.scale = 0.5
        self.calls = 0

    def forward(self, z):
        z = self.bn(self.fc(z))
        for layer in self.layers:
            z = torch.relu(layer(z))
{forward_extra}        return z * self.scale


M = Net()
""", {}, 0.35),
    "hooks": ("""\
HOOK_CALLS = []


def fwd_hook(mod, inp, out):
    return out * 2


def pre_hook(mod, inp):
    print("pre-hook", type(mod).__name__)


def count_hook(mod, inp, out):
    HOOK_CALLS.append(out.shape[0])


HANDLES = []
{initial_hooks}""", {}, 0.5),  # of the programs with nn_module
}

WRAPPER = """

class Wrapper(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net  # M, a submodule: its parameters, buffers and hooks are the model's

    def forward(self, *args, **kwargs):
        return f(*args, **kwargs)


MODEL = Wrapper(M)
"""
FORWARD_EXTRAS = ["", "        if self.training:\n            z = z + 1\n", "        self.steps += 1\n",
                  "        self.calls += 1\n", "        z = torch.nn.functional.dropout(z, 0.5, self.training)\n"]
PREFIX = {"S": "t", "V": "t", "M": "t", "int": "i", "float": "f", "bool": "b", "str": "s", "tlist": "l",
          "ttuple": "tup", "nlist": "nl", "flist": "fl", "tdict": "d", "odict": "od", "ddict": "dd",
          "icount": "cnt", "counter": "ctr", "iset": "st", "deque": "dq", "tuple": "tup", "npV": "a", "npM": "a"}
NOT_RETURNED = ("module", "bump", "fn:S", "fn:V", "argdict")
INT_LITERALS = ["1", "2", "0", "3", "-1"]
FLOAT_LITERALS = ["0.5", "1.5", "-0.25", "2.0"]


class ProgramGenerator:
    """Writes one program. Templates ask it for names by kind (`pick`), for a target to
    assign (`assign`, a fresh name at top level, an existing name of the same kind inside
    a block, so every name stays defined) and for nested blocks (`block`)."""

    def __init__(self, draw: Draw, backend: str = "eager"):
        self.draw = draw
        self.backend = backend
        self.exact = backend == "eager"  # weld: no random ops, no text of float values
        self.locals: dict[str, str] = {}  # local name -> kind (assignable)
        self.exprs: dict[str, str] = {}  # outside values the body reads: "d['w']", "OBJ.t", "G_N"
        self.frozen: set[str] = set()  # containers a loop is iterating: not changed in its body
        self.depth = 0
        self.features: set[str] = set()
        self.tags: set[str] = set()
        self.counter = itertools.count(1)

    # -- what templates call ------------------------------------------------------------------

    def has(self, feature: str) -> bool:
        return feature in self.features

    def kind(self, name: str) -> str:
        return self.locals.get(name) or self.exprs[name]

    def pick(self, *kinds: str) -> str | None:
        names = [n for n, k in itertools.chain(self.locals.items(), self.exprs.items()) if k in kinds]
        return self.draw.choice(names) if names else None

    def pick_mutable(self, *kinds: str) -> str | None:
        names = [n for n, k in itertools.chain(self.locals.items(), self.exprs.items())
                 if k in kinds and n not in self.frozen]
        return self.draw.choice(names) if names else None

    def pick_local(self, *kinds: str) -> str | None:
        names = [n for n, k in self.locals.items() if k in kinds and n not in self.frozen]
        return self.draw.choice(names) if names else None

    def number(self, kind: str | None = None) -> str:
        """An int or float expression: a name in scope, or a literal."""
        kinds = {"int": ("int",), "float": ("float", "int"), None: ("int", "float")}[kind]
        name = self.pick(*kinds)
        if name is None or self.draw.chance(0.3):
            return self.draw.choice(FLOAT_LITERALS if kind == "float" else INT_LITERALS)
        return name

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    def define(self, name: str, kind: str) -> None:
        self.locals[name] = kind

    def target(self, kind: str) -> str | None:
        existing = [n for n, k in self.locals.items() if k == kind and n not in self.frozen]
        if self.depth == 0 and (not existing or self.draw.chance(0.6)):
            return self.fresh(PREFIX.get(kind, "v"))
        return self.draw.choice(existing) if existing else None

    def assign(self, kind: str, expr: str) -> str | None:
        name = self.target(kind)
        if name is None:
            return None
        self.define(name, kind)
        return f"{name} = {expr}"

    def assign_lines(self, kind: str, expr: str) -> list[str] | None:
        line = self.assign(kind, expr)
        return None if line is None else [line]

    def block(self, size: int | None = None, extra: dict[str, str] | None = None,
              frozen: set | None = None) -> list[str]:
        """Indented statements of a nested block. Names it binds (loop variables) are
        dropped after it; it only reassigns outer names with values of the same kind."""
        saved_locals, saved_frozen = dict(self.locals), set(self.frozen)
        self.locals.update(extra or {})
        self.frozen |= {n for n in (frozen or ()) if n}
        self.depth += 1
        lines = []
        for _ in range(size or self.draw.integer(1, 2)):
            lines += self.statement()
        self.depth -= 1
        self.locals, self.frozen = saved_locals, saved_frozen
        return ["    " + line for line in lines] or ["    pass"]

    def statement(self) -> list[str]:
        usable = [t for t in TEMPLATES
                  if not (t.top_only and self.depth > 0) and (self.exact or not t.exact_only)
                  and (t.needs is None or t.needs in self.features)]
        for _ in range(12):
            chosen = self.draw.weighted(usable, [t.weight for t in usable])
            saved = dict(self.locals)
            lines = chosen.write(self)
            if lines:
                self.tags.add(chosen.tag)
                return lines
            self.locals = saved  # a template that gave up may have defined names
        return ["pass"]

    # -- the program ------------------------------------------------------------------------------

    def generate(self, origin: str = "") -> Case:
        d = self.draw
        for feature, (_, _, p) in SETUP.items():
            if feature == "hooks":
                continue
            if d.chance(p):
                self.features.add(feature)
        if "nn_module" in self.features and d.chance(SETUP["hooks"][2]):
            self.features.add("hooks")
        params, defaults, kwonly = self._parameters()
        body = [self.statement() for _ in range(d.integer(2, 9))]
        lines = [line for stmt in body for line in stmt]
        lines.append(self._return())
        glob = [g for g, feature in (("G_N, G_F, G_T, G_L, G_LAST", "globals"), ("NP_G", "numpy_global"))
                if feature in self.features]
        if glob:
            lines.insert(0, "global " + ", ".join(glob))
        signature = ", ".join(params + defaults + (["*"] + kwonly if kwonly else []))
        source = (HEADER + "\n\n" + self._setup() + f"def f({signature}):\n"
                  + textwrap.indent("\n".join(lines), "    ") + "\n")
        calls = self._calls(params, defaults, kwonly)
        target = "f"
        if "nn_module" in self.features and d.chance(0.2):  # drawn last: earlier choices stay as they were
            target = "MODEL"  # torchweld.compile(an nn.Module): a CompiledModule, its forward calling f
            source += WRAPPER
            self.tags.add("compiled_module")
        dynamic = d.weighted([None, True, False], [6, 3, 1])  # drawn last too
        if dynamic is not None:
            self.tags.add(f"dynamic_{str(dynamic).lower()}")
        tags = sorted(self.tags | self.features | {t for c in calls for t in self._call_tags(c)})
        return Case(source=source, calls=calls, backend=self.backend, target=target, features=tuple(tags),
                    origin=origin, dynamic=dynamic)

    def _parameters(self) -> tuple[list[str], list[str], list[str]]:
        d = self.draw
        params, defaults, kwonly = ["x"], [], []
        self.define("x", "M")
        if d.chance(0.75):
            params.append("y")
            self.define("y", d.choice(["M", "V"]))
        if d.chance(0.7):
            params.append("n")
            self.define("n", "int")
        if d.chance(0.45):
            params.append("lst")
            self.define("lst", "tlist")
        if d.chance(0.35):
            params.append("d")
            self.exprs.update({"d": "argdict", "d['w']": "M", "d['h']": "tlist"})
        for feature, (_, names, _) in SETUP.items():
            if feature in self.features:
                self.exprs.update(names)
        if "nn_module" in self.features:
            if d.chance(0.4):
                params.append("m")
                self.exprs.update({"m": "module", "m.scale": "float"})
            else:
                self.exprs.update({"M": "module", "M.scale": "float"})
        if d.chance(0.4):
            defaults.append("s=0.5")
            self.define("s", "float")
        if d.chance(0.2):
            defaults.append("acc=[]")
            self.define("acc", "nlist")
        if d.chance(0.3):
            kwonly.append("k=2")
            self.define("k", "int")
        return params, defaults, kwonly

    def _setup(self) -> str:
        parts = []
        for feature, (text, _, _) in SETUP.items():
            if feature not in self.features:
                continue
            if feature == "nn_module":
                extras = FORWARD_EXTRAS if self.exact else FORWARD_EXTRAS[:-1]
                text = text.replace("{forward_extra}", self.draw.choice(extras))
            if feature == "hooks":
                initial = self.draw.choice(["", "HANDLES.append(M.fc.register_forward_hook(fwd_hook))\n",
                                            "HANDLES.append(M.register_forward_pre_hook(pre_hook))\n",
                                            "HANDLES.append(M.layers[0].register_forward_hook(count_hook))\n"])
                self.handles = int(bool(initial))
                text = text.replace("{initial_hooks}", initial)
            parts.append(text)
        return "\n\n".join(parts) + "\n\n" if parts else ""

    def _return(self) -> str:
        names = [n for n, k in itertools.chain(self.locals.items(), self.exprs.items()) if k not in NOT_RETURNED]
        d = self.draw
        form = d.weighted(["tuple", "single", "dict", "none", "list"], [5, 2, 1, 1, 1])
        if form == "none":
            return "return None"
        picked = [d.choice(names) for _ in range(1 if form == "single" else d.integer(1, 4))]
        # most programs return what they computed last; the rest anything in scope
        recent = [n for n in self.locals if n not in picked and self.locals[n] not in NOT_RETURNED]
        if recent and d.chance(0.7):
            picked.append(recent[-1])
        if form == "single":
            return f"return {picked[-1]}"
        if form == "dict":
            return "return {" + ", ".join(f"'r{i}': {n}" for i, n in enumerate(picked)) + "}"
        if form == "list":
            return "return [" + ", ".join(picked) + "]"
        return "return " + ", ".join(picked) + ("," if len(picked) == 1 else "")

    # -- the calls --------------------------------------------------------------------------------

    def _calls(self, params: list[str], defaults: list[str], kwonly: list[str]) -> tuple[Call, ...]:
        d = self.draw
        vary_shape, vary_dtype = d.chance(0.5), d.chance(0.25)
        vary_default_dtype, vary_grad = d.chance(0.15), d.chance(0.3)
        self.layers = 1
        calls = []
        for i in range(d.integer(4, 6)):
            rows = d.choice([3, 2, 5]) if vary_shape and i > 0 else 3
            args = self._arguments(params, defaults, kwonly, rows, vary_dtype and i > 0)
            changes = "\n".join(self._change() for _ in range(d.weighted([0, 1, 2, 3], [7, 8, 4, 2]))) if i else ""
            calls.append(Call(
                args=args, changes=changes,
                default_dtype=d.choice(["float32", "float64"]) if vary_default_dtype and i > 0 else "float32",
                grad_mode=d.choice(list(GRAD_MODES)) if vary_grad else "enabled",
                seed=1000 * i + d.integer(0, 999)))
        return tuple(calls)

    def _arguments(self, params, defaults, kwonly, rows: int, vary_dtype: bool) -> str:
        d = self.draw
        lines = [f"R = {rows}"]
        dtype = d.weighted(["", "float64", "int64"], [6, 3, 1]) if vary_dtype else ""
        if dtype == "int64":
            lines.append("x = torch.randint(-3, 4, (R, 4))")
        else:
            lines.append(f"x = torch.randn(R, 4{', dtype=torch.' + dtype if dtype else ''})")
            if d.chance(0.08):
                lines[-1] += ".requires_grad_()"
        fresh_m, fresh_v = "torch.randn(R, 4)", "torch.randn(4)"
        values = {"x": "x"}
        if "y" in params:
            if self.locals["y"] == "M":
                options = [fresh_m, "x", "x[:]", "x.view(R, 4)", "x.clone()", "x.detach()", "x * 1"]
            else:
                options = [fresh_v, "x[0]", "x[1]", "x[-1]", "torch.ones(4)", "x.sum(0)"]
            lines.append(f"y = {options[0] if d.chance(0.6) else d.choice(options)}")
            values["y"] = "y"
        m_like = ["torch.randn(R, 4)", "x"] + (["y"] if self.locals.get("y") == "M" else [])
        if "n" in params:
            values["n"] = str(d.integer(-2, 6))
        if "lst" in params:
            values["lst"] = "[" + ", ".join(d.choice(m_like) for _ in range(d.integer(0, 3))) + "]"
        if "d" in params:
            h = ", ".join(d.choice(m_like) for _ in range(d.integer(0, 2)))
            values["d"] = f"{{'w': {d.choice(m_like)}, 'h': [{h}]}}"
        if "m" in params:
            values["m"] = "M"
        kwargs = {}
        if "s=0.5" in defaults and d.chance(0.5):
            kwargs["s"] = d.choice(FLOAT_LITERALS + ["0.0", "3.25"])
        if "acc=[]" in defaults and d.chance(0.15):
            kwargs["acc"] = "[1, 2]"
        if kwonly and d.chance(0.5):
            kwargs["k"] = str(d.integer(-2, 5))
        lines.append("args = (" + ", ".join(values[p] for p in params) + ("," if len(params) == 1 else "") + ")")
        lines.append("kwargs = {" + ", ".join(f"{k!r}: {v}" for k, v in kwargs.items()) + "}")
        return "\n".join(lines)

    def _change(self) -> str:
        """One change the driver makes to the program's state before a call."""
        d = self.draw
        i, f = d.integer(-2, 6), d.choice(["0.5", "-1.0", "2.5", "0.0", "3.0"])
        options = []
        if "globals" in self.features:
            options += [f"G_N = {i}", f"G_F = {f}", "G_T = torch.randn(4)", f"G_L.append({i})", f"G_L = [{i}, 4]",
                        "G_LAST = None"]
        if "object" in self.features:
            options += [f"OBJ.scale = {f}", f"OBJ.k = {i}", "OBJ.t = torch.randn(4)", "OBJ.hist.clear()",
                        "OBJ.t.mul_(-1)"]
        if "pymodule" in self.features:
            options += [f"cfgmod.k = {i}", f"cfgmod.scale = {f}"]
        if "helper" in self.features:
            options += [f"helper.__defaults__ = ({f},)", f"helper.__kwdefaults__ = {{'b': {i}}}",
                        f"noisy.__defaults__ = ({f},)"]
        if "s" in self.locals:
            options.append(f"f.__defaults__ = ({f},) + f.__defaults__[1:]")
        if "acc" in self.locals:
            options.append("f.__defaults__[-1].clear()")
        if "k" in self.locals:
            options.append(f"f.__kwdefaults__ = {{'k': {i}}}")
        if "scale_closure" in self.features:
            options += [f"SCALE = make_scale({f})", f"SCALE.__closure__[0].cell_contents = {f}"]
        if "numpy_global" in self.features:
            options += [f"NP_G = np.linspace(-1.0, 1.0, 4) * {f}", f"NP_G[0] = {f}"]
        if "nn_module" in self.features:
            options += ["M.eval()", "M.train()", "M.fc.weight.requires_grad_(False)", "M.fc.weight.requires_grad_(True)",
                        "M.layers.append(torch.nn.Linear(4, 4))", f"M.scale = {f}", "M.bn.momentum = 0.5",
                        "M.fc = torch.nn.Linear(4, 4)", "M.requires_grad_(False)"]
            if self.layers > 1:
                options.append("del M.layers[-1]")
        if "hooks" in self.features:
            options += ["HANDLES.append(M.fc.register_forward_hook(fwd_hook))",
                        "HANDLES.append(M.register_forward_pre_hook(pre_hook))",
                        "HANDLES.append(M.layers[-1].register_forward_hook(count_hook))"]
            if self.handles:
                options.append("HANDLES.pop().remove()")
        if not options:
            return ""
        change = d.choice(options)
        self.layers += {"M.layers.append(torch.nn.Linear(4, 4))": 1, "del M.layers[-1]": -1}.get(change, 0)
        if change.startswith("HANDLES"):
            self.handles += -1 if change.endswith("remove()") else 1
        return change

    @staticmethod
    def _call_tags(call: Call) -> set[str]:
        tags = set()
        if call.default_dtype != "float32":
            tags.add("default_dtype")
        if call.grad_mode != "enabled":
            tags.add("grad_mode_call")
        if "__defaults__" in call.changes or "__kwdefaults__" in call.changes:
            tags.add("defaults_changed")
        if "M.layers" in call.changes:
            tags.add("modulelist_changed")
        if "HANDLES" in call.changes:
            tags.add("hooks_changed")
        return tags


def generate_case(draw: Draw, backend: str = "eager", origin: str = "") -> Case:
    return ProgramGenerator(draw, backend).generate(origin)


def case_from_seed(case_seed: int, backend: str = "eager") -> Case:
    """The case one integer names (with its backend): what CI and the big runs generate,
    and what `python -m tests.fuzz.run --case N --backend B` runs again."""
    return generate_case(RandomDraw(random.Random(case_seed)), backend,
                         origin=f"python -m tests.fuzz.run --case {case_seed} --backend {backend}")
