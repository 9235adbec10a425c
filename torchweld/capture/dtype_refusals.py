"""Operations whose eager kernel refuses a dtype that the fake-tensor run accepts.

Capture runs each operation on fake tensors, whose meta functions check shapes but often not
dtypes: `x.var()`, `softmax`, `gelu`, `lerp`, `max_pool1d` of an int64 tensor, `relu` of a
bool one... run on fakes and return an int64 fake, where eager's kernel raises ("not
implemented for 'Long'"). Left alone, the graph holds an operation eager refuses: the capture-
only backend drops it when unused (the error is lost), and a compiler that decomposes it
computes a number where eager raised.

So an operation with an integer or bool tensor operand is also run once for real, on small
tensors of ones of the operands' dtypes (their shapes where small, else each size cut to 2).
If that raises and the same run with those operands in float32 does not, eager's kernel
refuses the dtype: capture breaks the graph there, and the eager run raises eager's error at
the user's line. Where both runs raise (the small shapes do not fit the operation), nothing is
concluded. The answer is kept per operation, operand dtypes and shapes and other arguments.
"""
from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree

from torchweld.capture.symbolic_sizes import hint

SMALL = 4096  # operands of at most this many elements are made in their own shape
_REFUSES: dict[tuple, str | None] = {}  # key -> eager's error message, or None where it runs
_MAX_REMEMBERED = 4096


def forget() -> None:
    """Drop the answers kept so far (torchweld.reset)."""
    _REFUSES.clear()


def needs_checking(target: object, operands: list) -> bool:
    """Whether an operand is an integer or bool tensor (the dtypes meta functions let through)."""
    if not _is_torch_operation(target):
        return False
    return any(isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())
               for t in pytree.tree_leaves(operands))


def refusal(target: object, run, args: list, kwargs: dict) -> str | None:
    """Eager's error message where its kernel refuses the operands' dtypes, else None."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    leaves = [_hinted(x) for x in leaves]  # symbolic sizes as their values now: no guard is added for a probe
    key = _key(target, leaves)
    if key is not None and key in _REFUSES:
        return _REFUSES[key]
    answer = _probe(run, leaves, spec)
    if key is not None:
        if len(_REFUSES) >= _MAX_REMEMBERED:
            _REFUSES.clear()
        _REFUSES[key] = answer
    return answer


def _hinted(x: object) -> object:
    """`x` with its symbolic sizes as their values now, also inside a slice (pytree's leaf)."""
    if isinstance(x, slice):
        return slice(hint(x.start), hint(x.stop), hint(x.step))
    return hint(x)


def _probe(run, leaves: list, spec) -> str | None:
    cuda = sorted({x.device.index or 0 for x in leaves if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):  # an op that draws (uniform_) draws nothing for real
        return _probe_runs(run, leaves, spec)


def _probe_runs(run, leaves: list, spec) -> str | None:
    try:
        _run_on(run, [_small_ones(x, x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        return None
    except Exception as e:  # the dtype's run raises: a refusal if float32 runs
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
    try:
        _run_on(run, [_small_ones(x, _float_dtype(x)) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    except Exception:
        return None  # the small operands do not fit: nothing concluded
    return message


def _run_on(run, leaves: list, spec) -> None:
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    run(*args, **kwargs)


def _small_ones(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    sizes = [hint(s) for s in t.shape]
    shape = sizes if math.prod(sizes) <= SMALL else tuple(min(s, 2) for s in sizes)
    return torch.ones(shape, dtype=dtype, device=t.device)


def _float_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.is_floating_point() or t.is_complex() else torch.float32


def _key(target: object, leaves: list) -> tuple | None:
    parts = [target]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sizes = tuple(hint(s) for s in x.shape)
            parts.append((x.dtype, sizes if math.prod(sizes) <= SMALL else x.dim(), x.device.type))
        else:
            parts.append((type(x), x))
    try:
        key = tuple(parts)
        hash(key)
        return key
    except TypeError:
        return None


def _is_torch_operation(target: object) -> bool:
    """A Tensor method (capture names it by string) or an operation of torch's own math namespaces
    or operator: running it once more on other tensors changes nothing else. Not a custom op
    (`torch.ops.<ns>`, `torch.library.custom_op`: its body may count or write), nor collectives,
    devices or autograd's state."""
    if isinstance(target, str):
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in ("aten", "prims")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0] in ("aten", "prims")
    return (getattr(target, "__module__", None) or "") in _PROBED_MODULES


# where torch's tensor operations live (torch.add: "torch", F.gelu: "torch._C._nn", ...)
_PROBED_MODULES = frozenset({
    "torch", "torch.functional", "torch.nn.functional", "torch._C._nn", "torch._C._linalg", "torch._C._fft",
    "torch._C._special", "torch._C._VariableFunctions", "torch.linalg", "torch.fft", "torch.special", "_operator",
})
