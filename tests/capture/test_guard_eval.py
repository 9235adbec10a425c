"""The C guard evaluator (guard_eval.c, laid out by guard_program.py) against the guards'
Python expression: both decide alike for every guard kind and source kind, on inputs that
pass and on inputs that fail one guard (the relations between symbolic sizes too, which
run as int64 programs); compiled models give eager's results and recompile exactly when
they should with either; the build falls back when it must."""
import builtins
import enum
import logging
import os
import random
import subprocess
import sys
import sysconfig
import threading
import time
import types
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn

import torchweld
from torchweld import config
from torchweld.capture import guard_extension, guard_program
from torchweld.capture.cache import LIVE_CACHES, MISS, build_entry, parameter_names
from torchweld.capture.guards import Guard, GuardSet, autocast_state
from torchweld.capture.report import TranslationReport
from torchweld.capture.sources import (
    AttrSource, BuiltinMethodCallSource, BuiltinSource, ClosureSource, DefaultSource, GlobalSource,
    ItemSource, LocalSource, ModuleEntrySource, ModuleGlobalSource, Source,
)
from torchweld.capture.symbolic_sizes import Bind, Relation
from tests.capture.helpers import CountingBackend, assert_same

needs_c = pytest.mark.skipif(guard_extension.load() is None, reason="the C guard evaluator cannot be built here")


@pytest.fixture(params=[pytest.param("c", marks=needs_c), "python"])
def evaluator(request):
    """Every model test runs with the C evaluator and with its Python fallback."""
    with config.patch(guard_evaluator=request.param):
        yield request.param


# ---------------------------------------------------------------------------
# One frame that reads a value of every source kind, guarded by every guard kind
# ---------------------------------------------------------------------------
class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Marker:
    pass


class OtherMarker:
    pass


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.p = 0.5
        self.shape_hint = (4, 4)

    def forward(self, x):
        return self.lin(x) * self.scale


class Dynamic(nn.Module):
    """A module with its own __getattr__: reads of it must not take nn.Module's shortcut."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2))
        self.size_seen = 7

    def __getattr__(self, name):
        if name == "dyn_size":
            return self.size_seen
        return super().__getattr__(name)


class Settings(dict):
    pass


class PlusOneSource(Source):
    """A source kind the evaluator's tables do not know: it runs as Python."""

    def name(self) -> str:
        return "L['k'] + 1"

    def expr(self) -> str:
        return "k + 1"


OFFSET = 3


def helper(x, alpha=2.0, *, beta=None):
    return x * alpha


def make_scaler(factor):
    def scale(x):
        return x * factor
    return scale


scale_by_two = make_scaler(2)


def make_frame():
    captured = 1.5

    def frame(x, m, k, d, items, *rest, **extra):
        return captured
    return frame


def inputs():
    """Fresh arguments for the frame: (args, kwargs)."""
    items = [None, Marker()]
    extra = {"flag": False, "cfg": Settings(mode="fast"), "dyn": Dynamic()}
    return (torch.randn(4, 4), Block(), 3, {"a": "hello", "b": items}, items, Color.RED), extra


def guards_for(args, kwargs) -> GuardSet:
    x, m, k, d, items, color = args
    L = LocalSource
    lin = ModuleEntrySource(L("m"), "lin", "_modules")
    dyn = ItemSource(L("extra"), "dyn")
    g = GuardSet()
    g.grad_mode(True)
    g.autocast(autocast_state())
    g.tensor(L("x"), x)
    g.constant(L("k"), k)
    g.identity(L("m"), m)
    g.identity(lin, m.lin)
    g.tensor(ModuleEntrySource(lin, "weight", "_parameters"), m.lin.weight)
    g.tensor(AttrSource(L("m"), "scale"), m.scale)  # a buffer read through nn.Module.__getattr__
    g.constant(AttrSource(L("m"), "p"), m.p)
    g.constant(AttrSource(L("m"), "training"), m.training)
    g.constant(AttrSource(L("m"), "shape_hint"), m.shape_hint)
    g.identity(AttrSource(AttrSource(L("m"), "forward"), "__func__"), Block.forward)
    g.identity(AttrSource(AttrSource(L("m"), "forward"), "__self__"), m)
    g.has_attr(L("m"), "lin", True)
    g.has_attr(L("m"), "nope", False)
    g.dict_keys(L("d"), ["a", "b"])
    g.constant(ItemSource(L("d"), "a"), "hello")
    g.length(L("items"), list, 2)
    g.constant(ItemSource(L("items"), 0), None)
    g.type_is(ItemSource(L("items"), 1), Marker)
    g.same_object(ItemSource(L("d"), "b"), L("items"))
    g.length(L("rest"), tuple, 1)
    g.constant(ItemSource(L("rest"), 0), color)
    g.dict_keys(L("extra"), list(kwargs))
    g.constant(ItemSource(L("extra"), "flag"), False)
    g.constant(BuiltinMethodCallSource("dict", "get", ItemSource(L("extra"), "cfg"), ("mode",)), "fast")
    g.type_is(dyn, Dynamic)
    g.constant(AttrSource(dyn, "dyn_size"), 7)
    g.tensor(AttrSource(dyn, "weight"), kwargs["dyn"].weight)
    g.identity(AttrSource(AttrSource(dyn, "forward"), "__func__"), Dynamic.forward)
    g.identity(GlobalSource("helper"), helper)
    g.constant(GlobalSource("OFFSET"), OFFSET)
    g.constant(DefaultSource(GlobalSource("helper"), 0), 2.0)
    g.constant(DefaultSource(GlobalSource("helper"), "beta"), None)
    g.constant(ModuleGlobalSource("tw_guard_eval_other", "LIMIT"), 4)
    g.identity(BuiltinSource("divmod"), divmod)
    g.constant(ClosureSource(None, 0, "captured"), 1.5)
    g.constant(ClosureSource(GlobalSource("scale_by_two"), 0, "factor"), 2)
    g.constant(PlusOneSource(), k + 1)
    g.guards.append(Guard("L['x'].numel() == 16", "x.numel() == 16", L("x")))  # a guard kind with no C test
    return g


@pytest.fixture(params=["module shortcut", "no module shortcut"])
def module_shortcut(request, monkeypatch):
    """With and without reading nn.Module attributes as Module.__getattr__ would."""
    if request.param == "no module shortcut":
        monkeypatch.setattr(guard_program, "mirrored_module_getattr", lambda: None)


@pytest.fixture
def other_module(monkeypatch):
    module = types.ModuleType("tw_guard_eval_other")
    module.LIMIT = 4
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def entry_for(fn, guards: GuardSet, evaluator: str):
    report = TranslationReport(fn.__qualname__, None, 0, guards.readable(), 0.0)
    with config.patch(guard_evaluator=evaluator):
        return build_entry(fn, guards, ["return 'hit'"], {}, report)


def decisions(fn, guards, args, kwargs) -> tuple[bool, bool]:
    """(C evaluator, Python expression): does each entry take these arguments?"""
    c, py = (entry_for(fn, guards, e) for e in ("c", "python"))
    assert "___guards(" in c.source and "___guards(" not in py.source
    return tuple(e.run(*args, **kwargs) is not MISS for e in (c, py))


@needs_c
def test_every_guard_holds_for_the_inputs_it_was_made_from(other_module, module_shortcut):
    fn = make_frame()
    args, kwargs = inputs()
    assert decisions(fn, guards_for(args, kwargs), args, kwargs) == (True, True)


@needs_c
def test_the_tables_run_every_guard_but_the_odd_ones_in_c(other_module):
    args, kwargs = inputs()
    guards = guards_for(args, kwargs)
    namespace = entry_for(make_frame(), guards, "c").namespace
    program = guard_program.GuardProgram(["x", "m", "k", "d", "items", "rest", "extra"], namespace)
    for guard in guards.guards:
        program.add_guard(guard)
    python_checks = [c for c in program.checks if c[0] == "python"]
    python_nodes = [n for n in program.nodes if n[0] == "python"]
    assert len(python_checks) == 1 and len(python_nodes) == 1  # the numel() guard; PlusOneSource
    assert {c[0] for c in program.checks} >= {"id", "type", "is", "equals", "len", "dict_keys", "same", "hasattr",
                                              "tensor", "call_is"}


def replace_lin(a, kw):
    a[1].lin = nn.Linear(4, 4)


def replace_weight_by_plain_tensor(a, kw):
    a[1].lin._parameters["weight"] = a[1].lin.weight.detach().clone()


def shadow_buffer(a, kw):
    a[1].__dict__["scale"] = torch.ones(5)


def rebind_forward(a, kw):
    a[1].forward = lambda x: x


def replace_forward_on_the_class(a, kw):
    Block.forward = lambda self, x: x


def make_forward_static(a, kw):
    Block.forward = staticmethod(Block.forward)


def set_global(name, value):
    def change(a, kw):
        globals()[name] = value
    return change


def set_closure(fn_of, value):
    def change(a, kw):
        fn_of().__closure__[0].cell_contents = value
    return change


# (what changes, a part of the text of the guard it must fail)
MUTATIONS = [
    ("tensor shape", lambda a, kw: a.__setitem__(0, torch.randn(2, 8)), "L['x']: Tensor"),
    ("tensor stride", lambda a, kw: a.__setitem__(0, torch.randn(4, 4).t()), "L['x']: Tensor"),
    ("tensor dtype", lambda a, kw: a.__setitem__(0, a[0].double()), "L['x']: Tensor"),
    ("tensor requires_grad", lambda a, kw: a.__setitem__(0, a[0].requires_grad_()), "L['x']: Tensor"),
    ("parameter requires_grad", lambda a, kw: a[1].lin.weight.requires_grad_(False), "weight: Parameter"),
    ("parameter replaced by a plain tensor", replace_weight_by_plain_tensor, "weight: Parameter"),
    ("constant", lambda a, kw: a.__setitem__(2, 4), "L['k'] == 3"),
    ("constant of another type", lambda a, kw: a.__setitem__(2, 3.0), "L['k'] == 3"),
    ("module replaced", lambda a, kw: a.__setitem__(1, Block()), "L['m'] is"),
    ("submodule replaced", replace_lin, "L['m'].lin is"),
    ("buffer shadowed in the instance __dict__", shadow_buffer, "L['m'].scale: Tensor"),
    ("float attribute", lambda a, kw: setattr(a[1], "p", 0.7), "L['m'].p == 0.5"),
    ("attribute deleted", lambda a, kw: delattr(a[1], "p"), "L['m'].p == 0.5"),
    ("training flag", lambda a, kw: a[1].eval(), "L['m'].training is True"),
    ("tuple attribute", lambda a, kw: setattr(a[1], "shape_hint", (4, 5)), "L['m'].shape_hint"),
    ("method shadowed by an instance attribute", rebind_forward, "L['m'].forward.__func__"),
    ("method replaced on the class", replace_forward_on_the_class, "L['m'].forward.__func__"),
    ("method made a staticmethod", make_forward_static, "L['m'].forward.__func__"),
    ("own __getattr__ method", lambda a, kw: setattr(kw["dyn"], "forward", print), "['dyn'].forward.__func__"),
    ("attribute gained", lambda a, kw: setattr(a[1], "nope", 1), "hasattr(L['m'], 'nope') is False"),
    ("submodule deleted", lambda a, kw: delattr(a[1], "lin"), "L['m'].lin is"),
    ("dict key added", lambda a, kw: a[3].__setitem__("c", 1), "list(L['d'])"),
    ("dict keys reordered", lambda a, kw: a.__setitem__(3, {"b": a[4], "a": "hello"}), "list(L['d'])"),
    ("dict value", lambda a, kw: a[3].__setitem__("a", "bye"), "L['d']['a'] == 'hello'"),
    ("list grown", lambda a, kw: a[4].append(1), "len(L['items']) == 2"),
    ("list item", lambda a, kw: a[4].__setitem__(0, 0), "L['items'][0] is None"),
    ("list item type", lambda a, kw: a[4].__setitem__(1, OtherMarker()), "type(L['items'][1]) is Marker"),
    ("same object no more", lambda a, kw: a[3].__setitem__("b", list(a[4])), "L['d']['b'] is L['items']"),
    ("enum member", lambda a, kw: a.__setitem__(5, Color.BLUE), "L['rest'][0] is"),
    ("*args longer", lambda a, kw: a.append(1), "len(L['rest']) == 1"),
    ("**kwargs key", lambda a, kw: kw.__setitem__("more", 1), "list(L['extra'])"),
    ("**kwargs value", lambda a, kw: kw.__setitem__("flag", True), "L['extra']['flag'] is False"),
    ("dict subclass method result", lambda a, kw: kw["cfg"].__setitem__("mode", "slow"), "dict.get("),
    ("own __getattr__", lambda a, kw: setattr(kw["dyn"], "size_seen", 8), "dyn_size == 7"),
    ("own __getattr__ parameter", lambda a, kw: kw["dyn"].weight.requires_grad_(False), ".weight: Parameter"),
    ("global function", set_global("helper", make_scaler(1)), "G['helper'] is"),
    ("global constant", set_global("OFFSET", 4), "G['OFFSET'] == 3"),
    ("positional default", lambda a, kw: setattr(helper, "__defaults__", (3.0,)), "__defaults__[0] == 2.0"),
    ("keyword default", lambda a, kw: setattr(helper, "__kwdefaults__", {"beta": 1}), "__kwdefaults__['beta'] is None"),
    ("other module's global", lambda a, kw: setattr(sys.modules["tw_guard_eval_other"], "LIMIT", 5), "['LIMIT'] == 4"),
    ("other module gone", lambda a, kw: sys.modules.pop("tw_guard_eval_other"), "['LIMIT'] == 4"),
    ("builtin", lambda a, kw: setattr(builtins, "divmod", lambda a, b: 0), "B['divmod'] is"),
    ("frame closure cell", set_closure(lambda: FRAME, 2.5), "C['captured'] == 1.5"),
    ("closure cell of a global function", set_closure(lambda: scale_by_two, 3), "cell_contents == 2"),
]

FRAME = make_frame()


@needs_c
@pytest.mark.parametrize("what,change,failing", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_both_evaluators_fail_the_changed_guard(other_module, module_shortcut, monkeypatch, what, change, failing):
    for name in ("helper", "OFFSET"):
        monkeypatch.setitem(globals(), name, globals()[name])
    monkeypatch.setattr(helper, "__defaults__", helper.__defaults__)
    monkeypatch.setattr(helper, "__kwdefaults__", helper.__kwdefaults__)
    monkeypatch.setattr(builtins, "divmod", divmod)
    monkeypatch.setattr(Block, "forward", Block.forward)
    monkeypatch.setitem(sys.modules, "tw_guard_eval_other", other_module)
    for fn in (FRAME, scale_by_two):
        monkeypatch.setattr(fn.__closure__[0], "cell_contents", fn.__closure__[0].cell_contents)
    args, kwargs = inputs()
    guards = guards_for(args, kwargs)
    args = list(args)
    change(args, kwargs)
    entry = entry_for(FRAME, guards, "python")
    x, m, k, d, items, *rest = args
    failed = entry.failing_guard((x, m, k, d, items, *rest), kwargs)
    assert failed is not None and failing in failed, failed
    assert decisions(FRAME, guards, args, kwargs) == (False, False)


@needs_c
def test_grad_mode_is_guarded(other_module):
    args, kwargs = inputs()
    guards = guards_for(args, kwargs)
    with torch.no_grad():
        assert decisions(FRAME, guards, args, kwargs) == (False, False)


@needs_c
def test_autocast_state_is_guarded(other_module):
    args, kwargs = inputs()
    guards = guards_for(args, kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert decisions(FRAME, guards, args, kwargs) == (False, False)
    assert decisions(FRAME, guards, args, kwargs) == (True, True)


@needs_c
def test_an_exception_is_a_miss_and_a_base_exception_propagates():
    class Flaky:
        error: type = ValueError

        @property
        def value(self):
            raise self.error("read failed")

    obj = Flaky()
    guards = GuardSet()
    guards.constant(AttrSource(LocalSource("o"), "value"), 1)

    def frame(o):
        return o

    assert decisions(frame, guards, (obj,), {}) == (False, False)
    assert not any(entry_for(frame, guards, e).check(obj) for e in ("c", "python"))
    Flaky.error = KeyboardInterrupt
    for evaluator in ("c", "python"):
        with pytest.raises(KeyboardInterrupt):
            entry_for(frame, guards, evaluator).run(obj)


@needs_c
def test_a_guard_that_calls_back_into_its_own_evaluator():
    """A property read by a guard calls the same entry again (the evaluator is reentrant)."""
    guards = GuardSet()
    guards.constant(AttrSource(LocalSource("o"), "value"), 1)

    def frame(o):
        return o

    entry = entry_for(frame, guards, "c")

    class Reentrant:
        depth = 0

        @property
        def value(self):
            Reentrant.depth += 1
            inner = Reentrant.depth < 3 and entry.run(self) is MISS
            return 2 if inner else 1

    assert entry.run(Reentrant()) == "hit"
    assert Reentrant.depth == 3


class CountedConfig:
    """Its attributes are read by Python code, as a transformers config's are."""

    reads = 0

    def __init__(self, flag):
        self.flag = flag

    def __getattribute__(self, name):
        CountedConfig.reads += 1
        return super().__getattribute__(name)


@needs_c
def test_an_attribute_python_code_reads_is_read_once_per_object_and_call():
    shared = CountedConfig(True)
    holder = types.SimpleNamespace(a=shared, b=shared, c=CountedConfig(False))
    h = LocalSource("h")
    guards = GuardSet()
    guards.has_attr(AttrSource(h, "a"), "flag", True)
    for path, flag in (("a", True), ("b", True), ("c", False)):
        guards.constant(AttrSource(AttrSource(h, path), "flag"), flag)

    def frame(h):
        return h

    entries = {e: entry_for(frame, guards, e) for e in ("c", "python")}
    reads = {}
    for evaluator, entry in entries.items():
        CountedConfig.reads = 0
        assert entry.run(holder) == "hit"
        reads[evaluator] = CountedConfig.reads
    assert reads == {"c": 2, "python": 4}  # shared.flag once (hasattr included), c.flag once
    holder.b = CountedConfig(False)  # another object now: read, and failing
    assert decisions(frame, guards, (holder,), {}) == (False, False)
    holder.b, holder.c = shared, shared
    assert decisions(frame, guards, (holder,), {}) == (False, False)


@needs_c
def test_the_guards_log_and_explain_read_the_same_with_either_evaluator():
    def fn(x, m):
        return m(x).relu()

    model, x = Block(), torch.randn(4)
    texts = []
    for evaluator in ("c", "python"):
        with config.patch(guard_evaluator=evaluator):
            torchweld.reset()
            texts.append(torchweld.explain(fn)(x, model).guards)
    assert texts[0] == texts[1] and texts[0]


# ---------------------------------------------------------------------------
# Compiled models, with the C evaluator and with the Python expression
# ---------------------------------------------------------------------------
def assert_guards_ran_in(evaluator: str) -> None:
    entries = [e for cache in LIVE_CACHES for e in cache.cache_entries]
    assert entries and all(("___guards(" in e.source) == (evaluator == "c") for e in entries)


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        att = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * self.scale
        y = self.drop(att.softmax(-1)) @ v.transpose(1, 2)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class TransformerBlock(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.use_mlp = True

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x)) if self.use_mlp else x


def test_transformer_block_matches_eager_and_recompiles_when_it_should(evaluator):
    model = TransformerBlock().eval()
    backend = CountingBackend()
    fn = torchweld.compile(model, backend=backend)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fn(x), model(x))
        assert len(backend.graphs) == 1
        y = torch.randn(2, 7, 16)
        torch.testing.assert_close(fn(y), model(y))
        assert len(backend.graphs) == 2  # a new shape
        model.use_mlp = False
        torch.testing.assert_close(fn(x), model(x))
        assert len(backend.graphs) == 3  # a guarded attribute changed
        model.use_mlp = True
        model.attn.out = nn.Linear(16, 16)
        torch.testing.assert_close(fn(x), model(x))
        assert len(backend.graphs) == 4  # a submodule replaced
        torch.testing.assert_close(fn(x), model(x))
        assert len(backend.graphs) == 4
    model.train()
    fn(x)
    assert len(backend.graphs) == 5  # training mode and grad mode
    assert_guards_ran_in(evaluator)


def test_tiny_gpt2_matches_eager_and_recompiles_when_it_should(evaluator):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2Model(cfg).eval()
    backend = CountingBackend()
    fn = torchweld.compile(lambda ids: model(ids).last_hidden_state, backend=backend)
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fn(ids), model(ids).last_hidden_state)
        graphs = len(backend.graphs)
        longer = torch.randint(0, 100, (1, 12))
        torch.testing.assert_close(fn(longer), model(longer).last_hidden_state)
        assert len(backend.graphs) > graphs  # a new length
        graphs = len(backend.graphs)
        torch.testing.assert_close(fn(ids), model(ids).last_hidden_state)
        assert len(backend.graphs) == graphs  # the first version still fits
        weight = model.h[1].mlp.c_fc.weight
        weight.data = torch.randn_like(weight)  # same metadata: no recompile, new values
        torch.testing.assert_close(fn(ids), model(ids).last_hidden_state)
        assert len(backend.graphs) == graphs
        model.config.output_hidden_states = True  # read through the config's own __getattribute__
        fn(ids)
        assert len(backend.graphs) > graphs
    assert_guards_ran_in(evaluator)


# ---------------------------------------------------------------------------
# Symbolic sizes: the tensors with symbolic dims and the relations between sizes
# ---------------------------------------------------------------------------
def views(x):
    return x.view(x.shape[0], -1).sum(1) + x.reshape(-1, x.size(-1)).mean()


def halves(x):
    half = x.shape[0] // 2
    return x[:half] * 2 - x[x.shape[0] - half:]


def branch(x):
    if x.shape[0] > 4:
        return x + 1
    return x - 1


def plus(x, y):
    return x + y


def prefix(x, n):
    return x[:n] * n


def relu_mean(x):
    return x.relu() + x.mean()


def float_slice(x):
    return x.view(-1)[: int(x.shape[0] * 1.5)] * 2  # a relation over floats: 1.5 * float(s0) == 9.0


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def channels_last(*shape):
    return torch.randn(*shape).to(memory_format=torch.channels_last)


def marked(x):
    torchweld.mark_dynamic(x, 0, min=2, max=10)
    return x


class SizeCase(NamedTuple):
    fn: object
    first: tuple  # the call that compiles
    takes: list  # calls its guards take
    refuses: list  # calls they refuse: the first breaks a relation between sizes
    dynamic: bool | None = True
    in_python: int = 0  # relations left to Python


SIZE_CASES = {
    "view and reshape with -1": SizeCase(views, (t(4, 3, 4),), [(t(6, 5, 6),), (t(2, 2, 2),), (t(3, 7, 3),)],
                                         [(t(4, 3, 5),), (t(4, 3, 4).transpose(0, 2),), (t(1, 3, 1),), (t(0, 3, 0),),
                                          (t(4, 3, 4, dtype=torch.float64),), ("x",), (t(4, 3),), (t(4, 3, 4, 1),)]),
    "floor division of a size": SizeCase(halves, (t(6, 3),), [(t(8, 3),), (t(9, 5),), (t(4, 2),)],
                                         [(t(3, 3),), (t(2, 3),), (t(12, 3)[::2],), (t(6, 1),), (None,)]),
    "branch on a size": SizeCase(branch, (t(6),), [(t(5),), (t(100),)],
                                 [(t(4),), (t(1),), (t(0),), (t(12)[::2],), (t(6).requires_grad_(),), ([1.0] * 6,)]),
    "equal sizes of two inputs": SizeCase(plus, (t(5), t(5)), [(t(7), t(7)), (t(2), t(2))],
                                          [(t(7), t(1)), (t(7), t(8)), (t(7), 3.0), (t(7), t(1, 7)),
                                           (t(7), t(7, dtype=torch.float64))]),
    "marked with a range": SizeCase(halves, (marked(t(6, 3)),), [(t(8, 3),), (t(10, 3),), (marked(t(4, 3)),)],
                                    [(t(11, 3),), (t(8, 4),), (t(8),)], dynamic=None),
    "an int argument": SizeCase(prefix, (t(8), 3), [(t(10), 5), (t(4), 4), (t(8), 2)],
                                [(t(8), 9), (t(8), 1), (t(8), -2), (t(8), True), (t(8), 3.0), (t(8), 2 ** 70),
                                 (t(8), -2 ** 70)]),
    "transposed": SizeCase(relu_mean, (t(5, 3).t(),), [(t(7, 4).t(),), (t(2, 2).t(),)],
                           [(t(3, 5),), (t(3, 10)[:, ::2],), (t(5, 3),)]),
    "channels last": SizeCase(relu_mean, (channels_last(2, 3, 4, 5),),
                              [(channels_last(3, 4, 5, 6),), (channels_last(2, 2, 2, 2),)],
                              [(t(2, 3, 4, 5),), (channels_last(2, 3, 4, 1),), (t(2, 3, 4, 5).transpose(1, 2),)]),
    "a relation over floats": SizeCase(float_slice, (t(6, 4),), [(t(6, 5),), (t(6, 2),)], [(t(8, 4),), (t(4, 4),)],
                                       in_python=1),
}


@needs_c
@pytest.mark.parametrize("case", SIZE_CASES, ids=list(SIZE_CASES))
def test_symbolic_size_guards_run_in_c_and_decide_as_python_does(case, caplog):
    fn, first, takes, refuses, dynamic, in_python = SIZE_CASES[case]
    compiled = torchweld.compile(fn, backend=CountingBackend(), dynamic=dynamic)
    compiled(*first)
    (entry,) = compiled.cache_entries
    with caplog.at_level(logging.INFO, logger="torchweld.guards"):
        program = guard_program.lay_out(entry.guards, parameter_names(fn.__code__), entry.namespace)
    kinds = [check[0] for check in program.checks]
    assert "python" not in kinds and "symbolic_tensor" in kinds
    (sizes,) = [check for check in program.checks if check[0] == "sizes"]
    reads, code, functions, _ = sizes[3]
    assert len(functions) == code.count("call") == in_python
    assert len([r for r in caplog.records if "runs as Python" in r.getMessage()]) == in_python
    for args in [first, *takes]:
        assert decisions(fn, entry.guards, args, {}) == (True, True), args
    for args in refuses:
        assert decisions(fn, entry.guards, args, {}) == (False, False), args


@pytest.mark.parametrize("case", SIZE_CASES, ids=list(SIZE_CASES))
def test_symbolic_sizes_match_eager_and_recompile_when_a_relation_breaks(case, evaluator):
    fn, first, takes, refuses, dynamic, _ = SIZE_CASES[case]
    backend = CountingBackend()
    compiled = torchweld.compile(fn, backend=backend, dynamic=dynamic)
    for args in [first, *takes]:
        assert_same(compiled(*args), fn(*args))
    assert len(backend.graphs) == 1
    assert_same(compiled(*refuses[0]), fn(*refuses[0]))
    assert len(backend.graphs) == 2
    for args in takes:  # the first version still takes them
        assert_same(compiled(*args), fn(*args))
    assert len(backend.graphs) == 2
    assert_guards_ran_in(evaluator)


class GivenSizes:
    """A size guard of given bindings and relations (symbolic_sizes.SizeGuard's `parts`)."""

    def __init__(self, binds: list[Bind], relations: list[Relation]):
        self.binds, self.relations = binds, relations

    def parts(self, module):
        return self.binds, self.relations


def random_int_expression(rng: random.Random, depth: int) -> str:
    """Python over the symbols ___s0, ___s1 (sizes) and ___n (an int argument, any int), with
    what the size programs compute, and what they leave to Python (a negative power, huge numbers)."""
    if depth == 0 or rng.random() < 0.25:
        return rng.choice(["___s0", "___s1", "___n", "0", "1", "3", "-1", "-7", str(2 ** 62), str(2 ** 63 - 1), "True"])
    a, b = random_int_expression(rng, depth - 1), random_int_expression(rng, depth - 1)
    return rng.choice([
        f"({a} {rng.choice(['+', '-', '*', '//', '%'])} {b})",
        f"({a} ** {rng.choice(['0', '2', '3', '___s0', '-1', '64'])})",
        f"{rng.choice(['max', 'min'])}({a}, {b})", f"abs({a})", f"(-{a})", f"(not {a})",
        f"({a} {rng.choice(['==', '!=', '<', '<=', '>', '>='])} {b})",
        f"({a} {rng.choice(['and', 'or'])} {b})",
    ])


@needs_c
def test_size_programs_compute_as_python_does_overflow_and_all():
    """Random relations over two sizes and an int argument, on inputs whose values overflow int64,
    divide by zero, are not ints, or are not tensors: the C evaluator decides as Python does."""
    L = LocalSource
    binds = [Bind("s0", "L['x'].size()[0]", "x.size(0)", L("x"), 0),
             Bind("s1", "L['x'].size()[1]", "x.size(1)", L("x"), 1), Bind("n", "L['n']", "n", L("n"), None)]
    ints = (-3, 0, 1, 2, 2 ** 40, 2 ** 63 - 1, -2 ** 63)
    calls = [(t(a, b), n) for a, b in ((0, 1), (1, 3), (4, 2), (7, 3)) for n in ints]
    calls += [(t(3, 2), 2 ** 70), (t(3, 2), True), (t(3, 2), 3.0), (t(3), 2), ("x", 2), (nn.Parameter(t(3, 2)), 2)]

    def frame(x, n):
        return x

    rng = random.Random(0)
    for _ in range(120):
        text = random_int_expression(rng, 4)
        guards = GuardSet()
        guards.sizes(GivenSizes(binds, [Relation(text, text)]))
        entries = [entry_for(frame, guards, e) for e in ("c", "python")]
        for x, n in calls:
            c, py = (e.run(x, n) is not MISS for e in entries)
            assert c == py, (text, x if isinstance(x, str) else tuple(x.shape), n)


# ---------------------------------------------------------------------------
# Building the extension
# ---------------------------------------------------------------------------
def test_no_compiler_falls_back_to_python_and_says_so_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(config, "cc", "no-such-compiler-tw")  # CC=no-such-compiler-tw
    guard_extension.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="torchweld.guards"), config.patch(guard_evaluator="c"):
            backend = CountingBackend()
            fn = torchweld.compile(lambda x: x.sin() + 1, backend=backend)
            for x in (torch.randn(3), torch.randn(3), torch.randn(5)):
                torch.testing.assert_close(fn(x), x.sin() + 1)
        assert len(backend.graphs) == 2
        assert all("___guards(" not in e.source for e in fn.cache_entries)
        said = [r for r in caplog.records if "no-such-compiler-tw" in r.getMessage()]
        assert len(said) == 1
    finally:
        guard_extension.load.cache_clear()


@needs_c
def test_processes_building_at_once_all_load_it(tmp_path):
    code = "from torchweld.capture import guard_extension; assert guard_extension.load() is not None"
    env = {**os.environ, "TORCHWELD_CACHE_DIR": str(tmp_path), "TORCHWELD_HELPERS_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    assert len(list((tmp_path / "guards").glob(f"guard_eval_*{suffix}"))) == 1  # one library, beside its source
    assert not list((tmp_path / "guards").glob("*.tmp"))


def test_the_build_starts_in_the_background_when_capture_begins(monkeypatch, tmp_path):
    """The evaluator's C build runs in a thread started as the first frame is translated, so
    tracing overlaps it; the entry's guards then wait for that one build, never start another."""
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    builders = []
    real = guard_extension.load_extension

    def spy(*args, **kwargs):
        builders.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(guard_extension, "load_extension", spy)
    guard_extension.load.cache_clear()
    try:
        with config.patch(guard_evaluator="c"):
            fn = torchweld.compile(lambda x: x.cos() * 2, backend=CountingBackend())
            x = torch.randn(4)
            torch.testing.assert_close(fn(x), x.cos() * 2)
        assert builders == ["torchweld-build-load"]
        if guard_extension.load() is not None:
            assert all("___guards(" in e.source for e in fn.cache_entries)
    finally:
        guard_extension.load.cache_clear()


def test_loaded_once_runs_the_loader_once_across_threads():
    from torchweld.c_extension import loaded_once

    calls = []
    started = threading.Event()

    @loaded_once
    def load():
        started.set()
        time.sleep(0.2)
        calls.append(threading.current_thread().name)
        return "module"

    load.start_in_background()
    started.wait(5)
    load.start_in_background()  # already running: no second thread
    assert [load() for _ in range(3)] == ["module"] * 3
    assert calls == ["torchweld-build-load"]
