"""The guards one translation collected: what must hold of the frame's inputs for
its graph to be reused. Each guard has a readable form (for `explain()` and the
`guards` log), a Python expression, and the same test as a kind plus operands,
which the C guard evaluator (guard_program.py) runs without the expression."""
from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

from torchweld.capture.sources import AttrSource, CallResultSource, ConstantSource, ItemSource, LocalSource, Source


@dataclasses.dataclass(frozen=True)
class Guard:
    """One condition on one source. `kind` and `operands` say what `expr` tests, for the C
    guard evaluator: tensor (type, dtype, device, shape, stride or None, requires_grad),
    symbolic_tensor (type, dtype, device, shape with None for each symbolic dim, requires_grad),
    sizes (symbolic_sizes.Bind tuple, symbolic_sizes.Relation tuple) with no source,
    id (id,), type (cls,), is (obj,), equals (cls, value), len (cls, n), dict_keys (keys,),
    same (first_source,), hasattr (attr, present), call_is (fn, result) with no source,
    instance_dict (names of empty containers, names absent) on the object's own __dict__, lacks (key,),
    held_tensor (dtype, device index, requires_grad);
    python (): only `expr` says it."""

    text: str  # readable: "L['x']: Tensor(dtype=float32, shape=(4,), ...)"
    expr: str  # Python over the entry function's names and the GuardSet's constants
    source: Source | None = None  # what it checks; its spelling in `expr` is shared across guards
    kind: str = "python"  # the test `expr` spells (see above)
    operands: tuple = ()  # what that test compares the source's value with


# an nn.Module's own hook dicts; hooks in any of them run around its forward in eager
MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# torch.nn.modules.module's hook dicts that apply to every module
GLOBAL_MODULE_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                            "_global_backward_pre_hooks")

AUTOCAST_DEVICES = ("cpu", "cuda")
_autocast_states: dict[tuple, tuple] = {}


def autocast_state() -> tuple | None:
    """None outside `torch.autocast` (one C call, the common case); else the autocast dtype (or
    None) of each of AUTOCAST_DEVICES and whether autocast caches casts, as one interned tuple,
    so that a guard compares states with `is`."""
    if not torch._C._is_any_autocast_enabled():
        return None
    state = (*(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in AUTOCAST_DEVICES),
             torch.is_autocast_cache_enabled())
    return _autocast_states.setdefault(state, state)


class HookFence:
    """How many hook handles torch had made (`RemovableHandle.next_id`: every register_*_hook
    makes one) when the guards that modules have no hooks last held. While the count has not
    moved, no hook was registered anywhere, and those guards (one per module called) need no
    check: a call tests one integer instead of every module's hook dicts."""

    def __init__(self) -> None:
        self.seen = [RemovableHandle.next_id]  # a list: guard_eval.c updates it in place too

    def unchanged(self) -> bool:
        return RemovableHandle.next_id == self.seen[0]

    def passed(self) -> bool:
        """Called once the hook guards held again: later calls may skip them."""
        self.seen[0] = RemovableHandle.next_id
        return True


class GuardSet:
    """Collects guards without duplicates and the constants their expressions name."""

    def __init__(self) -> None:
        self.guards: list[Guard] = []
        # guards that modules have no hooks: checked after all others, and only where a hook
        # handle was made since they last held (HookFence)
        self.hook_guards: list[Guard] = []
        self.hook_fence = HookFence()
        self.constants: dict[str, object] = {}  # name in the guard expression -> object
        self._seen: set[tuple[str, str]] = set()
        self._weak_targets: dict[int, object] = {}  # id -> object guarded by identity (held: the id stays its own)
        self._fence_name = self.name_constant(self.hook_fence)  # named now: before any namespace is made

    # -- adding guards ---------------------------------------------------------
    def _add(self, key: tuple[str, str], text: str, expr: str, source: Source | None = None,
             kind: str = "python", operands: tuple = (), about_hooks: bool = False) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        (self.hook_guards if about_hooks else self.guards).append(Guard(text, expr, source, kind, operands))

    def name_constant(self, obj: object) -> str:
        """A name for `obj` in the entry function's namespace, which guards' and sources'
        expressions may use."""
        name = f"___g{len(self.constants)}"
        self.constants[name] = obj
        return name

    def source_of(self, obj: object) -> ConstantSource:
        """A source that reads `obj` itself, which capture holds (and keeps alive)."""
        kind = "class" if isinstance(obj, type) else type(obj).__name__
        readable = f"<{kind} {getattr(obj, '__qualname__', '')} at {id(obj):#x}>"
        return ConstantSource(self.name_constant(obj), readable)

    def call_result_source(self, function: Source, args: tuple, kwargs: dict) -> CallResultSource:
        """A source that calls `function` with these constant arguments."""
        readable = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        return CallResultSource(function, self.name_constant((args, kwargs)), readable)

    def tensor(self, source: Source, t: torch.Tensor, symbolic_dims: tuple[int, ...] = ()) -> None:
        """`source` holds a tensor of `t`'s type, dtype, device, shape, strides and requires_grad;
        with `symbolic_dims`, of its number of dims and its other sizes only (the size guard,
        `sizes`, checks those dims and the strides)."""
        if symbolic_dims:
            self._tensor_of_symbolic_sizes(source, t, symbolic_dims)
            return
        stride = tuple(t.stride()) if t.layout is torch.strided else None  # None: not checked
        parts = [f"type({{e}}) is {self.name_constant(type(t))}", f"{{e}}.dtype is {self.name_constant(t.dtype)}"]
        parts.append(f"{{e}}.device == {self.name_constant(t.device)}")
        parts.append(f"{{e}}.shape == {tuple(t.shape)!r}")
        if stride is not None:
            parts.append(f"{{e}}.stride() == {stride!r}")
        parts.append(f"{{e}}.requires_grad is {t.requires_grad}")
        e = source.expr()
        text = (
            f"{source.name()}: {type(t).__name__}(dtype={t.dtype}, device={t.device}, "
            f"shape={tuple(t.shape)}, stride={stride}, requires_grad={t.requires_grad})"
        )
        operands = (type(t), t.dtype, t.device, tuple(t.shape), stride, t.requires_grad)
        expr = " and ".join(p.format(e=e) for p in parts)
        self._add((source.name(), "tensor"), text, expr, source, "tensor", operands)

    def _tensor_of_symbolic_sizes(self, source: Source, t: torch.Tensor, symbolic_dims: tuple[int, ...]) -> None:
        e = source.expr()
        sizes = [("*" if d in symbolic_dims else str(n)) for d, n in enumerate(t.shape)]
        parts = [f"type({e}) is {self.name_constant(type(t))}", f"{e}.dtype is {self.name_constant(t.dtype)}",
                 f"{e}.device == {self.name_constant(t.device)}", f"{e}.dim() == {t.dim()}"]
        parts += [f"{e}.size({d}) == {n}" for d, n in enumerate(t.shape) if d not in symbolic_dims]
        parts.append(f"{e}.requires_grad is {t.requires_grad}")
        text = (f"{source.name()}: {type(t).__name__}(dtype={t.dtype}, device={t.device}, "
                f"shape=({', '.join(sizes)}{',' if len(sizes) == 1 else ''}), requires_grad={t.requires_grad}) "
                "(* symbolic: see the size guard)")
        shape = tuple(None if d in symbolic_dims else n for d, n in enumerate(t.shape))
        self._add((source.name(), "tensor"), text, " and ".join(parts), source, "symbolic_tensor",
                  (type(t), t.dtype, t.device, shape, t.requires_grad))

    def sizes(self, size_guard) -> None:
        """The relations between symbolic sizes (symbolic_sizes.SizeGuard): one check over the
        inputs' sizes and strides, which binds each symbol to the size it reads first, then tests
        each relation. Operands: (the bindings, the relations), which the C evaluator runs
        (guard_program.py) and the recompile message names (cache.py)."""
        binds, relations = size_guard.parts(self.name_constant)
        if not binds and not relations:
            return
        checks = [f"((___{b.symbol} := {b.read}) is not None)" for b in binds]
        checks += [f"({r.expr})" for r in relations]
        text = "symbolic sizes: " + "; ".join([f"{b.symbol} = {b.readable}" for b in binds]
                                              + [r.readable for r in relations])
        self._add(("", "sizes"), text, " and ".join(checks), None, "sizes", (tuple(binds), tuple(relations)))

    def held_tensor(self, source: Source, t: torch.Tensor) -> None:
        """For a tensor a module holds, guarded by identity too: what its owner can change in place
        (`module.double()`, `.cuda()`, `requires_grad_()`), checked at a third of a full tensor
        guard's cost (its shape and strides are not: only a `.data =` of another shape changes them)."""
        e = source.expr()
        text = f"{source.name()}: dtype={t.dtype}, device={t.device}, requires_grad={t.requires_grad}"
        expr = (f"{e}.dtype is {self.name_constant(t.dtype)} and {e}.get_device() == {t.get_device()} "
                f"and {e}.requires_grad is {t.requires_grad}")
        self._add((source.name(), "tensor"), text, expr, source, "held_tensor", (t.dtype, t.get_device(), t.requires_grad))

    def constant(self, source: Source, value: object) -> None:
        e = source.expr()
        if value is None or isinstance(value, bool):
            self._add((source.name(), "const"), f"{source.name()} is {value!r}", f"{e} is {value!r}", source,
                      "is", (value,))
            return
        if isinstance(value, enum.Enum):  # a singleton, whatever its value type (class Action(str, Enum))
            self._add((source.name(), "const"), f"{source.name()} is {value!r}", f"{e} is {self.name_constant(value)}", source,
                      "is", (value,))
            return
        if type(value) in (int, float, str, bytes) and not (isinstance(value, float) and value != value):
            expr = f"type({e}) is {type(value).__name__} and {e} == {value!r}"
        else:
            expr = f"type({e}) is {self.name_constant(type(value))} and {e} == {self.name_constant(value)}"
        self._add((source.name(), "const"), f"{source.name()} == {value!r}", expr, source,
                  "equals", (type(value), value))

    def identity(self, source: Source, obj: object) -> None:
        self._keep_weakly(obj)
        text = f"{source.name()} is {_describe(obj)}"
        self._add((source.name(), "id"), text, f"id({source.expr()}) == {id(obj)}", source, "id", (id(obj),))

    def identity_matched_arguments(self) -> list[str]:
        """The names of the frame's arguments that a guard holds by identity (`L['self'] is <Block>`)."""
        return [g.source.local for g in self.guards
                if g.kind == "id" and isinstance(g.source, LocalSource)]

    def comparison(self, source: Source, symbol: str, other: object, outcome: bool) -> None:
        """`source <symbol> other` is `outcome`: for a float read as a graph input that Python
        compares (`if lr > 0.5:`), its answer, not its value."""
        text = f"({source.name()} {symbol} {other!r}) is {outcome}"
        self._add((source.name(), f"cmp {symbol} {other!r}"), text,
                  f"({source.expr()} {symbol} {self.name_constant(other)}) is {outcome}", source)

    def truthiness(self, source: Source, truthy: bool) -> None:
        """`bool(source)` is `truthy`: for a number read anew at each call whose being zero
        or not decides what the graph computes (SGD's momentum)."""
        e = source.expr()
        self._add((source.name(), "truth"), f"bool({source.name()}) is {truthy}", f"bool({e}) is {truthy}", source)

    def type_is(self, source: Source, cls: type) -> None:
        text = f"type({source.name()}) is {cls.__qualname__}"
        self._add((source.name(), "type"), text, f"type({source.expr()}) is {self.name_constant(cls)}", source, "type", (cls,))

    def length(self, source: Source, cls: type, n: int) -> None:
        e = source.expr()
        text = f"type({source.name()}) is {cls.__name__} and len({source.name()}) == {n}"
        self._add((source.name(), "len"), text, f"type({e}) is {self.name_constant(cls)} and len({e}) == {n}", source,
                  "len", (cls, n))

    def dict_keys(self, source: Source, keys: list) -> None:
        e = source.expr()
        text = f"type({source.name()}) is dict and list({source.name()}) == {keys!r}"
        self._add((source.name(), "keys"), text, f"type({e}) is dict and list({e}) == {self.name_constant(keys)}", source,
                  "dict_keys", (keys,))

    def lacks(self, source: Source, key: object) -> None:
        """`key not in source`: a global name that would shadow the builtin the graph used."""
        text = f"{key!r} not in {source.name()}"
        self._add((source.name(), f"lacks {key!r}"), text, f"{key!r} not in {source.expr()}", source, "lacks", (key,))

    def distinct(self, source: Source, other: Source) -> None:
        """`source is not other`: the graph took them for two objects (`x is y` was False)."""
        text = f"{source.name()} is not {other.name()}"
        self._add((source.name(), f"distinct {other.name()}"), text, f"{source.expr()} is not {other.expr()}")

    def keys_are(self, source: Source, cls: type, keys: list) -> None:
        """`source` is a `cls` whose keys are `keys`, in order (an OrderedDict of hooks)."""
        e = source.expr()
        text = f"type({source.name()}) is {cls.__name__} and list({source.name()}) == {keys!r}"
        self._add((source.name(), "keys"), text, f"type({e}) is {self.name_constant(cls)} and list({e}) == {keys!r}",
                  source)

    def same_object(self, source: Source, first: Source) -> None:
        text = f"{source.name()} is {first.name()}"
        self._add((source.name(), "same"), text, f"{source.expr()} is {first.expr()}", source, "same", (first,))

    def has_attr(self, source: Source, attr: str, present: bool) -> None:
        text = f"hasattr({source.name()}, {attr!r}) is {present}"
        self._add((source.name(), f"hasattr {attr}"), text, f"hasattr({source.expr()}, {attr!r}) is {present}", source,
                  "hasattr", (attr, present))

    def plain_module(self, source: Source) -> None:
        """The module at `source` has no hooks and no `forward` of its own (set on the instance):
        calling it runs its class's forward and nothing else, as the graph assumed."""
        e = source.expr()
        empty = " and ".join(f"not {e}.{name}" for name in MODULE_HOOK_DICTS)
        text = f"{source.name()} has no hooks and no forward of its own"
        self._add((source.name(), "plain_module"), text, f"{empty} and 'forward' not in {e}.__dict__", source,
                  "instance_dict", (MODULE_HOOK_DICTS, ("forward",)), about_hooks=True)

    def no_global_hooks(self, source: Source, cls: type) -> None:
        """One of torch.nn.modules.module's global hook dicts is empty."""
        e = source.expr()
        self._add((source.name(), "len"), f"{source.name()} is empty", f"type({e}) is {self.name_constant(cls)} and len({e}) == 0",
                  source, "len", (cls, 0), about_hooks=True)

    def grad_mode(self, enabled: bool) -> None:
        fn = self.name_constant(torch.is_grad_enabled)
        self._add(("", "grad_mode"), f"torch.is_grad_enabled() is {enabled}", f"{fn}() is {enabled}", None,
                  "call_is", (torch.is_grad_enabled, enabled))

    def process_state(self, query: Callable[[], object], value: object, readable: str) -> None:
        """`query()` is `value` (an interned object: a dtype, a bool, a small int), for state of the
        process that the graph assumed: `torch.get_default_dtype()` for `torch.ones(3)`."""
        self._add(("", readable), f"{readable} is {value!r}", f"{self.name_constant(query)}() is {self.name_constant(value)}",
                  None, "call_is", (query, value))

    def autocast(self, state: object) -> None:
        """The autocast state at capture (`autocast_state()`): a graph traced under
        `torch.autocast` has its casts in it, and one traced outside has none. Outside
        autocast (nearly every call) the check is one C function, with no Python frame."""
        if state is None:
            fn, value, text = torch._C._is_any_autocast_enabled, False, "torch.autocast is off"
        else:
            fn, value, text = autocast_state, state, f"torch.autocast state is {state}"
        self._add(("", "autocast"), text, f"{self.name_constant(fn)}() is {self.name_constant(value)}", None,
                  "call_is", (fn, value))

    # -- results ---------------------------------------------------------------
    def expression(self) -> str:
        """All guards as one `and` chain. A value read by several guards (`self.layer1`
        for every guard below it) is read once, into a variable, where first needed."""
        names: dict[str, str] = {}

        def spell(source: Source) -> str:
            if source.name() in names:
                return names[source.name()]
            base = getattr(source, "base", None)
            if isinstance(source, (AttrSource, ItemSource)) and base is not None:
                own = source.on(spell(base))
            elif isinstance(source, LocalSource):
                return source.expr()  # already a plain name
            else:
                own = source.expr()
            name = names[source.name()] = f"___v{len(names)}"
            return f"({name} := {own})"

        def spelled(guard: Guard) -> str:
            expr = guard.expr
            if guard.source is not None and not isinstance(guard.source, LocalSource):
                plain = guard.source.expr()
                first = spell(guard.source)  # "(___vK := <chain>)" the first time, else "___vK"
                later = names.get(guard.source.name(), plain)
                expr = expr.replace(plain, "\0", 1).replace(plain, later).replace("\0", first)
            return f"({expr})"

        parts = [spelled(guard) for guard in self.guards]
        if self.hook_guards:  # last: the variables they name first are read by no guard after them
            fence = self._fence_name
            hooks = " and ".join(spelled(guard) for guard in self.hook_guards)
            parts.append(f"({fence}.unchanged() or ({hooks} and {fence}.passed()))")
        return " and ".join(parts) or "True"

    @property
    def all_guards(self) -> list[Guard]:
        return [*self.guards, *self.hook_guards]

    def readable(self) -> list[str]:
        return [g.text for g in self.all_guards]

    def watch_identity(self, on_death: Callable[[], None]) -> list[weakref.ref]:
        """Weak references that call `on_death` once an object guarded by identity dies
        (its id could then be reused by an unrelated object)."""
        refs = []
        targets, self._weak_targets = self._weak_targets, {}  # hold them weakly from now on
        for obj in targets.values():
            try:
                refs.append(weakref.ref(obj, lambda _ref: on_death()))
            except TypeError:  # not weakly referenceable: kept alive by the constant table
                self.constants[f"___alive{len(self.constants)}"] = obj
        return refs

    def _keep_weakly(self, obj: object) -> None:
        self._weak_targets.setdefault(id(obj), obj)


def _describe(obj: object) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if name:
        return f"<{name}>"
    return f"<{type(obj).__name__} object at {id(obj):#x}>"
