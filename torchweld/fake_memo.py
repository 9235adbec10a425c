"""Results of aten ops on fake tensors, replayed from their metadata.

An op on fake tensors computes no data, only the result's size, strides, dtype and
device, which depend on nothing but the same of its inputs and its other arguments.
FakeTensorMode caches that (its dispatch cache), but a hit still costs ~80 us on the
development CPU: it describes every argument in full (memory format, storage bytes,
sparsity, symbolic sizes) and checks the result again. A traced training graph
dispatches thousands of ops, most of them repeats (GPT-2's 12 layers are one layer
twelve times, forward and backward), so weld's joint trace spends a quarter of its
time there. This memo keys an op by what its result can depend on for the dense,
static-shaped fake tensors weld traces with, and builds the result directly (~15 us):

    out = fake_memo.run(func, args, kwargs)   # in place of func(*args, **kwargs), in a dispatch mode
    with fake_mode, fake_memo.Memo():         # or a mode of its own above a FakeTensorMode
        ...

Only ops whose schema promises a fresh result, a view or a list of views of their first
argument (split, unbind), or an in-place write of their first argument alone take part: no
out= ops, no ops whose result shape depends on data, no composite views (which may or may
not alias), no arguments that are real tensors; fakes standing for constants only among
the arguments of a fresh result that has another fake too. Anything else, and every first
sight of a key, runs through FakeTensorMode as before, and its result is remembered only
where it is plain: dense tensors, not one of the inputs.

Fakes of symbolic sizes (a mode with a ShapeEnv) take part too, keyed by their sizes'
expressions in a table of their ShapeEnv's own: a repeat asks nothing the first call did
not already ask that ShapeEnv (and record as a guard), and their ops are where symbolic
sizes cost most (each size operation is a sympy one: a view ~0.8 ms through the mode).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from torchweld.fake_tensors import meta_on_fresh_storage, storage_elements

_DEVICE = torch.ops.prim.device.default
_FRESH, _VIEW, _IN_PLACE, _VIEWS = 1, 2, 3, 4
_RETURNS_SELF = ("self",)  # what an in-place op's entry holds: it returned its first argument, unchanged in layout
_kinds: dict[torch._ops.OpOverload, int | None] = {}  # op -> _FRESH, _VIEW, _IN_PLACE, _VIEWS or None (not memoized)
_results: dict[tuple, tuple] = {}  # key -> (list, True for a tuple or False, then (size, stride, offset, dtype, device) per output)
_symbolic_results: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()  # ShapeEnv -> its table
_PYTHON_DISPATCHER = torch._C.DispatchKey.PythonDispatcher
_MAX_ENTRIES = 200_000  # forgotten all at once beyond this (a long-running process tracing many models)
_unsaved: list = []  # keys of results over static sizes remembered since export() last ran
_portable: dict = {}  # what export() gives: the results over static sizes, each op by its name
_absorbed: set = set()  # the keys of _portable that absorb() read (the rest this process learned)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_SKIP_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view)


def forget() -> None:
    """Drop the remembered results (torchweld.reset)."""
    _kinds.clear()
    _results.clear()
    _symbolic_results.clear()
    _unsaved.clear()
    _portable.clear()
    _absorbed.clear()


class Memo(TorchDispatchMode):
    """A dispatch mode that runs each op through `run`, for use above a FakeTensorMode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return run(func, args, kwargs or {})


def run(func, args: tuple, kwargs: dict):
    """`func(*args, **kwargs)` on fake tensors, from memory where the same call was seen."""
    if func is _DEVICE:  # a fake's device, asked by C++ code for every op: FakeTensor's own answer, directly
        tensor = args[0]
        if type(tensor) is FakeTensor and not tensor.fake_mode.in_kernel_invocation:
            return tensor.fake_device
        return func(*args, **kwargs)
    kind = _kinds.get(func, 0)
    if kind == 0:
        kind = _kinds[func] = _kind(func)
    if kind is None:
        return func(*args, **kwargs)
    parts = [func, torch.get_default_dtype(), torch.is_inference_mode_enabled()]
    modes: list = []
    fakes = [0, 0]  # how many fakes, how many of them stand for constants
    if not (_describe(args, parts, modes, fakes) and _describe(kwargs.values(), parts, modes, fakes)) \
            or not modes or fakes[1] and not (kind == _FRESH and fakes[1] < fakes[0]):
        # (constants: only a fresh result of some fake that is not one; FakeTensorMode computes
        # a constant's ops where all its fakes are constants, and keeps or forgets the values
        # of its views and of those written; a result's metadata depends on no tensor's values,
        # as ops whose does are not memoized)
        return func(*args, **kwargs)
    mode = modes[0]
    table = _results
    if mode.shape_env is not None:
        if kind == _IN_PLACE:  # (its check that the layout stayed would compare sizes over symbols)
            return func(*args, **kwargs)
        table = _symbolic_results.setdefault(mode.shape_env, {})
        parts.append(torch._C._dispatch_tls_is_dispatch_key_included(_PYTHON_DISPATCHER))  # (decides meta kernels)
    key = (*parts, *kwargs)
    known = table.get(key)
    if kind == _IN_PLACE:
        if known == _RETURNS_SELF:
            return args[0]
        layout = _layout(args[0])
        out = func(*args, **kwargs)
        outputs = _RETURNS_SELF if out is args[0] and _layout(out) == layout else None
    elif known is not None:
        return _rebuild(known, mode, args[0] if kind in (_VIEW, _VIEWS) else None)
    else:
        out = func(*args, **kwargs)
        outputs = _remember(out, mode, args, kind)
    if outputs is not None:
        if len(table) >= _MAX_ENTRIES:
            table.clear()
            if table is _results:
                _unsaved.clear()
                _portable.clear()
                _absorbed.clear()
        table[key] = outputs
        if table is _results:
            _unsaved.append(key)
    return out


def unsaved() -> int:
    """How many results over static sizes were remembered since `export` last ran."""
    return len(_unsaved)


def export(learned_only: bool = False) -> dict:
    """The results over static sizes, with each op by its name ("aten.add.Tensor"): what
    fake_memo_disk.py writes (entries holding anything else than plain values are left out);
    with `learned_only`, those this process learned, not those `absorb` gave it. Each result is
    converted once, at the first export after it was remembered."""
    keys = _unsaved[:]  # (a compile thread may add results meanwhile: they wait for the next export)
    del _unsaved[:len(keys)]
    for key in keys:
        result = _results.get(key)
        if result is not None and _plain(key[1:]) and _plain(result):
            _portable[(str(key[0]), *key[1:])] = result
    if learned_only:
        return {k: v for k, v in _portable.items() if k not in _absorbed}
    return dict(_portable)


def absorb(entries: dict) -> int:
    """Add results `export` gave (here, or in another process with the same torch and the same
    format of entries: fake_memo_disk names its file by both and seals it) to the remembered
    ones; the number added. Entries of ops this torch lacks are skipped; the rest are checked
    only for their outline (a full check of each took ~40 us, densenet121's ~1500 60 ms)."""
    ops: dict[str, object] = {}
    added = 0
    for key, result in entries.items():
        if type(key) is not tuple or not key or type(result) is not tuple or not result:
            continue  # not an entry export made
        name = key[0]
        op = ops[name] if name in ops else ops.setdefault(name, _op_named(name))
        if op is not None:
            added += _results.setdefault((op, *key[1:]), result) is result
            if key not in _portable:  # written again with this process's own
                _portable[key] = result
                _absorbed.add(key)
    return added


_PLAIN_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PLAIN_CLASSES = frozenset({*_PLAIN_TYPES, list, tuple})  # the classes _describe puts in a key


def _plain(value) -> bool:
    """Whether `value` holds only numbers, strings, torch's dtypes/devices/layouts and tuples
    of them, and the classes of those (what a key or result of static sizes is made of)."""
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return type(value) in _PLAIN_TYPES or (type(value) is type and value in _PLAIN_CLASSES)


def _op_named(name: str):
    """The OpOverload named `name` ("aten.add.Tensor"), or None where this torch has none."""
    parts = name.split(".") if isinstance(name, str) else ()
    if len(parts) != 3 or parts[0] not in ("aten", "prims"):
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, torch._ops.OpOverload) else None


def _kind(func) -> int | None:
    """Whether calls of `func` are memoized: as fresh results, as a view or a list of views
    of the first argument, as in-place ops on the first argument (x.relu_()), or not at all."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace not in ("aten", "prims"):
        return None
    schema = func._schema
    returns = schema.returns
    if not returns or any(tag in func.tags for tag in _SKIP_TAGS):
        return None
    if schema.is_mutable:
        return _IN_PLACE if _writes_first_argument_only(schema) else None
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
    first = schema.arguments[0].alias_info if schema.arguments else None
    if (len(returns) == 1 and str(returns[0].type) == "List[Tensor]" and returns[0].alias_info is not None
            and first is not None and first.before_set and not composite):
        return _VIEWS  # split, split_with_sizes, unbind: a list of views of the first argument
    if func is torch.ops.aten._unsafe_view.default or any(str(r.type) != "Tensor" for r in returns):
        return None
    aliases = [r.alias_info for r in returns]
    if not any(aliases):
        return _FRESH
    if len(returns) == 1 and first is not None and aliases[0].before_set == first.before_set and not composite:
        return _VIEW
    return None


def _writes_first_argument_only(schema) -> bool:
    """Whether an op writes its first argument alone and returns it (add_, relu_, copy_; not
    out= ops, nor batch norm's update of its running statistics)."""
    arguments = [a for a in (*schema.arguments,) if a.alias_info is not None and a.alias_info.is_write]
    if len(schema.returns) != 1 or len(arguments) != 1 or arguments[0] is not schema.arguments[0]:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and alias.is_write and alias.before_set == arguments[0].alias_info.before_set


def _layout(t) -> tuple:
    """What an in-place op must leave as it was for its call to be remembered (resize_ and
    set_ change it)."""
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage()._cdata)


def _describe(values, parts: list, modes: list, fakes: list) -> bool:
    """Append to `parts` what each of `values` contributes to a result's metadata, and count
    the fakes in fakes[0], those standing for constants (`torch.tensor([])`) in fakes[1];
    False where one cannot be described (a real tensor, an unknown object)."""
    for value in values:
        kind = type(value)
        if kind is FakeTensor:
            if value.layout is not torch.strided:
                return False
            fakes[0] += 1
            fakes[1] += value.constant is not None
            if not modes:
                modes.append(value.fake_mode)
            elif value.fake_mode is not modes[0]:
                return False
            shape, stride, offset = value.shape, value.stride(), value.storage_offset()
            if value.fake_mode.shape_env is not None:  # sizes that may be SymInts: by their expressions
                shape, stride, offset = tuple(map(_size_key, shape)), tuple(map(_size_key, stride)), _size_key(offset)
            parts.append((value.dtype, shape, stride, offset, value.fake_device,
                          value.requires_grad, value.is_conj(), value.is_neg()))
        elif kind in _SYMBOLIC:
            parts.append(_size_key(value))
        elif kind in (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format):
            parts.append(kind)  # 1, 1.0 and True are equal keys but give different dtypes
            parts.append(value)
        elif kind in (list, tuple):
            parts.append(len(value))
            if not _describe(value, parts, modes, fakes):
                return False
        else:
            return False
    return True


def _size_key(n: object) -> object:
    """A size (an int or a SymInt; a SymFloat, a SymBool) as a key: a symbolic one by its expression."""
    return ("sym", n.node.expr) if type(n) in _SYMBOLIC else n


def _remember(out, mode, args: tuple, kind: int) -> tuple | None:
    """The metadata of `out` (a fake tensor or a tuple of them) to rebuild it from, or None
    where it is not plain (an input returned, another mode's tensor, a result that requires
    grad or a fresh one that does not start its storage, sizes of data: unbacked symbols)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    infos = []
    for t in outs:
        if type(t) is not FakeTensor or t.fake_mode is not mode or t.constant is not None or t.is_conj() or t.is_neg():
            return None
        if t.layout is not torch.strided or t.requires_grad or any(t is a for a in args):
            return None
        if kind == _FRESH and t.storage_offset() != 0:
            return None
        size, stride = tuple(t.shape), t.stride()
        if not all(type(n) is int or type(n) is torch.SymInt and n.node.has_hint() for n in (*size, *stride)):
            return None
        info = (size, stride, t.storage_offset(), t.dtype, t.fake_device)
        if kind == _FRESH and mode.shape_env is not None:  # over symbols: its storage's elements, for _rebuild
            info += (storage_elements(t),)
        infos.append(info)
    return (list if isinstance(out, list) else isinstance(out, tuple), *infos)


@contextlib.contextmanager
def _meta_kernels():
    """Ops on fake tensors run their meta kernels, as inside FakeTensorMode's dispatch, in this
    thread alone (its in_kernel_invocation_manager also marks the mode, which a compile's
    threads share, and asserts the two agree)."""
    with torch._C._PreserveDispatchKeyGuard():
        torch._C._set_meta_in_tls_dispatch_include(True)
        yield


def _rebuild(known: tuple, mode, base: FakeTensor | None):
    """New fake tensors of `mode` with the remembered metadata; views of `base`'s storage
    where given. Over symbols a view is as_strided of `base` and a fresh result is made on a
    fresh storage of its remembered elements (fake_tensors.meta_on_fresh_storage): empty_strided
    and set_ computed and checked a storage size in sympy, 0.5-1.2 ms a result in BERT's capture
    over symbols (~500 results, mostly its 12 layers' repeats), against ~60 us (a view) and
    ~300 us (fresh). The Python dispatcher, on in a capture over symbols, is off here (its
    kernels took ~12% more)."""
    container, *infos = known  # list, True (a tuple) or False (one tensor)
    outs = []
    for size, stride, offset, dtype, device, *elements in infos:
        with no_dispatch(), torch._C._DisablePythonDispatcher():
            if base is not None:
                with _meta_kernels():  # (not base's fake device's kernel)
                    meta = torch.as_strided(base, size, stride, offset)
            elif elements:
                meta = meta_on_fresh_storage(elements[0], size, stride, offset, dtype)
            else:
                meta = torch.empty_strided(size, stride, dtype=dtype, device="meta")
        outs.append(FakeTensor(mode, meta, device))
    if container is list:
        return outs
    return tuple(outs) if container else outs[0]
