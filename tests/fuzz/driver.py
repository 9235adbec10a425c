"""Run one case eagerly and compiled, call by call, and compare every call: what it
returned or raised, what it printed, its arguments and the module's state afterwards,
and which outputs alias inputs.

Eager and compiled each get their own module, loaded from the same source under the
same seed, and their own arguments, built from the same source under the same seed:
equal deep copies, with aliasing between arguments kept (`args = (x, x[0])`)."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import linecache
import logging
import re
import traceback
import types
from typing import Callable

import torch

import torchweld
from tests.fuzz.case import Call, Case
from tests.fuzz.compare import Comparator, ObjectIndex, describe_alias, module_state, output_aliases

GRAD_CONTEXTS = {
    "enabled": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


class GeneratorError(Exception):
    """The generated case itself is broken (its module does not load, its state changes
    raise): a bug of the grammar, not of the compiler."""


@dataclasses.dataclass
class Difference:
    call: int
    what: str  # "raised", "internal", "printed", "output", "aliasing", "arguments", "state"
    detail: str
    key: str = ""  # the detail without values, to group failures: "eager returned; compiled KeyError at ..."

    def __str__(self) -> str:
        return f"call {self.call}: {self.what}: {self.detail}"

    @property
    def signature(self) -> str:
        return f"{self.what}: {self.key or _value_free(self.detail)}"


def _value_free(detail: str) -> str:
    """A difference's path and first words, indices and numbers dropped."""
    first = detail.split("\n")[0]
    first = re.sub(r"\[\d+\]", "[i]", first)
    first = re.sub(r"tensor\(.*", "tensor", first)
    first = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", first)
    return " ".join(first.split()[:8])


@dataclasses.dataclass
class Outcome:
    case: Case
    calls: int  # calls run and compared
    differences: list[Difference]
    eager_raised: int  # calls where eager raised (the compiled call had to raise the same)

    @property
    def signature(self) -> str:
        return self.differences[0].signature if self.differences else "ok"

    @property
    def kind(self) -> str:
        """"ok", or the first difference's kind (a crash is decided by the worker pool)."""
        return self.differences[0].what if self.differences else "ok"

    def report(self) -> str:
        lines = [self.case.report(), "=== differences ==="]
        lines += [str(d) for d in self.differences] or ["none"]
        return "\n".join(lines) + "\n"


@dataclasses.dataclass
class SideCall:
    result: object
    error: BaseException | None
    printed: str
    args: tuple
    kwargs: dict
    index: ObjectIndex  # arguments and module state before and after the call
    # the gradients of a fixed weighting of the outputs that require grad, with respect to
    # the leaf tensors that require grad (arguments, globals, the program's modules'
    # parameters), in one order for eager and compiled; None where there was nothing to
    # differentiate, the error's text where autograd raised (gradients_of)
    grads: list | str | None = None


def load(case: Case) -> types.ModuleType:
    """A fresh module holding the program (the same parameters each time: seeded)."""
    module = types.ModuleType("fuzz_program")
    filename = source_filename(case)
    linecache.cache[filename] = (len(case.source), None, case.source.splitlines(True), filename)
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.manual_seed(0)
        exec(compile(case.source, filename, "exec"), module.__dict__)
    except Exception as e:
        raise GeneratorError(f"the program's module does not load: {type(e).__name__}: {e}") from e
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
    if not hasattr(module, case.target):
        raise GeneratorError(f"the program's module has no {case.target!r} to compile")
    return module


def source_filename(case: Case) -> str:
    return f"<fuzz program {case.key}>"


@contextlib.contextmanager
def call_state(call: Call):
    """The default dtype and grad mode a call runs under; both restored after it."""
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    torch.set_default_dtype(DTYPES[call.default_dtype])
    try:
        with GRAD_CONTEXTS[call.grad_mode]():
            yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)


def run_call(module: types.ModuleType, fn, call: Call) -> SideCall:
    with call_state(call):
        torch.manual_seed(call.seed)
        try:
            exec(call.changes, module.__dict__)
            torch.manual_seed(call.seed + 1)
            scope = dict(module.__dict__)
            exec(call.args, scope)
        except Exception as e:
            raise GeneratorError(f"a call's state changes or arguments raise: {type(e).__name__}: {e}") from e
        args, kwargs = scope["args"], scope["kwargs"]
        index = ObjectIndex()
        _index_inputs(index, args, kwargs, module)
        torch.manual_seed(call.seed + 2)
        printed = io.StringIO()
        result, error = None, None
        with contextlib.redirect_stdout(printed):
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                error = e
        _index_inputs(index, args, kwargs, module)  # what the call stored (G_LAST = t) counts too
        grads = gradients_of(result, args, kwargs, module) if error is None else None
    return SideCall(result, error, printed.getvalue(), args, kwargs, index, grads)


def gradients_of(result: object, args: tuple, kwargs: dict, module: types.ModuleType) -> list | str | None:
    """d(sum of each floating output that requires grad, times fixed weights)/d(each leaf
    tensor that requires grad), by torch.autograd.grad (no .grad is written, the graph is
    kept: the program's state is as the call left it). The weights come from a generator of
    their own (the global one's draws are the program's)."""
    try:  # reading grad_fn raises too (a view made under no_grad of a base changed in place since)
        outputs = [t for t in _tensors(result) if t.requires_grad and t.grad_fn is not None and t.is_floating_point()]
        leaves = [t for t in _tensors((args, kwargs, list(module_state(module).values())), modules=True)
                  if t.requires_grad and t.is_leaf]
        if not outputs or not leaves:
            return None
        weights = torch.Generator().manual_seed(1234)
        loss = sum((t * torch.rand(t.shape, generator=weights).to(t.device, t.dtype)).sum() for t in outputs)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=True)
    except RuntimeError as e:  # eager's: an input changed in place after autograd saved it
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return [g if g is None else g.detach() for g in grads]


def _zeros_as_none(eager: list, compiled: list) -> tuple[list, list]:
    """Both lists with None where one holds None and the other zeros: a parameter the outputs
    do not reach, whose graph computes what they read, gets zeros from a compiled backward and
    None from eager's (README's "Not supported yet"; torch.compile's does the same)."""
    pairs = [(None, None) if (a is None) != (b is None) and not (a if b is None else b).any() else (a, b)
             for a, b in zip(eager, compiled)]
    return [a for a, _ in pairs], [b for _, b in pairs]


def _tensors(value: object, modules: bool = False, depth: int = 0) -> list[torch.Tensor]:
    """The distinct tensors in `value` (nested lists, tuples, dicts; with `modules`, the
    parameters and buffers of nn.Modules), in a deterministic order."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(v, depth):
        if depth > 6:
            return
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen.add(id(v))
                found.append(v)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item, depth + 1)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item, depth + 1)
        elif modules and isinstance(v, torch.nn.Module):
            for t in [*v.parameters(), *v.buffers()]:
                walk(t, depth + 1)

    walk(value, depth)
    return found


def _index_inputs(index: ObjectIndex, args: tuple, kwargs: dict, module: types.ModuleType) -> None:
    for i, a in enumerate(args):
        index.add(a, f"args[{i}]")
    for k, v in kwargs.items():
        index.add(v, f"kwargs[{k!r}]")
    for name, value in module_state(module).items():
        index.add(value, f"G.{name}")


def compare_call(i: int, eager: SideCall, compiled: SideCall, eager_module, compiled_module,
                 exact: bool) -> list[Difference]:
    diffs = []
    if type(eager.error) is not type(compiled.error):
        internal = compiled.error is not None and raised_inside_torchweld(compiled.error)
        key = (f"eager {type(eager.error).__name__ if eager.error else 'returned'}; "
               f"compiled {type(compiled.error).__name__ if compiled.error else 'returned'}")
        if internal:
            key += f" at {torchweld_frame(compiled.error)}"
        diffs.append(Difference(i, "internal" if internal else "raised",
                                f"eager {_outcome(eager)}; compiled {_outcome(compiled)}", key))
        return diffs
    if eager.printed != compiled.printed:
        diffs.append(Difference(i, "printed", f"eager printed {eager.printed!r}; compiled printed {compiled.printed!r}"))
    if eager.error is None:
        values = Comparator(exact_floats=exact)
        values.compare(eager.result, compiled.result, "out")
        diffs += [Difference(i, "output", line) for line in values.lines]
        if not values.lines:
            ours, theirs = output_aliases(eager.result, eager.index), output_aliases(compiled.result, compiled.index)
            for path in ours:
                if ours[path] != theirs.get(path):
                    diffs.append(Difference(i, "aliasing", f"{path}: eager {describe_alias(ours[path])}; "
                                                           f"compiled {describe_alias(theirs.get(path))}"))
    if isinstance(eager.grads, list) and isinstance(compiled.grads, str):
        diffs.append(Difference(i, "gradient", f"eager's gradients were computed; compiled's raised {compiled.grads}"))
    elif isinstance(eager.grads, list) and isinstance(compiled.grads, list):
        # (where eager's raised, a compiled graph may compute them: its functional graph saves
        # values, not tensors a later in-place change invalidates)
        gradients = Comparator(exact_floats=exact)
        gradients.compare(*_zeros_as_none(eager.grads, compiled.grads), "grads")
        diffs += [Difference(i, "gradient", line) for line in gradients.lines]
    after = Comparator(exact_floats=exact)
    after.compare(eager.args, compiled.args, "args")
    after.compare(eager.kwargs, compiled.kwargs, "kwargs")
    diffs += [Difference(i, "arguments", line) for line in after.lines]
    ours, theirs = module_state(eager_module), module_state(compiled_module)
    state = Comparator(exact_floats=exact)
    if list(ours) != list(theirs):
        state.add("G", f"names {sorted(ours)} (eager) != {sorted(theirs)} (compiled)")
    for name in [n for n in ours if n in theirs]:
        state.compare(ours[name], theirs[name], f"G.{name}")
    diffs += [Difference(i, "state", line) for line in state.lines]
    return diffs


def raised_inside_torchweld(error: BaseException) -> bool:
    """True when the error comes from torchweld's own code (below the program's last
    frame), not from the program or a torch operation the program called."""
    if isinstance(error, torchweld.errors.TorchweldError):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    program = [i for i, f in enumerate(frames) if f.filename.startswith("<fuzz program")]
    ours = [i for i, f in enumerate(frames) if "/torchweld/" in f.filename]
    return bool(ours) and (not program or ours[-1] > program[-1])


def torchweld_frame(error: BaseException) -> str:
    """The innermost torchweld function the error passed through: "capture/operators.py:delitem"."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/torchweld/" in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.rsplit('/torchweld/', 1)[1]}:{f.name}"


def _outcome(side: SideCall) -> str:
    if side.error is None:
        text = repr(side.result)
        return "returned " + (text if len(text) < 200 else text[:200] + "...")
    frames = traceback.format_exception(side.error)
    where = "".join(frames[-4:-1]).strip() if raised_inside_torchweld(side.error) else ""
    return f"raised {type(side.error).__name__}: {side.error}" + (f"\n      at {where}" if where else "")


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """torch logs a traceback each time a fake tensor's meta function raises, which
    generated programs do on purpose (torch.stack([])); the raised error is compared."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_case(case: Case, backend: Callable | None = None) -> Outcome:
    """Every call of the case, eager then compiled (with `backend` in place of the case's,
    if given); stops at the first call that differs (their states have parted)."""
    with quiet_fake_tensor_log():
        return _run_case(case, backend or case.backend)


def _run_case(case: Case, backend) -> Outcome:
    eager_module, compiled_module = load(case), load(case)
    eager_fn = getattr(eager_module, case.target)
    compiled_fn = torchweld.compile(getattr(compiled_module, case.target), backend=backend, dynamic=case.dynamic)
    exact = case.backend == "eager"
    eager_raised = 0
    try:
        for i, call in enumerate(case.calls):
            eager = run_call(eager_module, eager_fn, call)
            compiled = run_call(compiled_module, compiled_fn, call)
            eager_raised += eager.error is not None
            diffs = compare_call(i, eager, compiled, eager_module, compiled_module, exact)
            if diffs:
                return Outcome(case, i + 1, diffs, eager_raised)
        return Outcome(case, len(case.calls), [], eager_raised)
    finally:
        torchweld.reset()
        linecache.cache.pop(source_filename(case), None)
