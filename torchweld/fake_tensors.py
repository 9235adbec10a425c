"""Fake copies of real tensors, made cheaply.

Capture runs every operation on fake tensors, and the weld backend traces each graph
to aten on fake tensors again, so every parameter and buffer of a model is faked at
least twice per compile. `FakeTensorMode.from_tensor` does it through torch's
MetaConverter, which describes the tensor in full (views, subclasses, symbolic
sizes, storage sharing) and costs about 0.2 ms a tensor: 0.14 s for the 728
tensors of a DenseNet-121 in capture, twice that in the aten trace. A parameter or
buffer is the simple case - dense, strided, owning its storage from offset 0 -
whose fake is one meta allocation with its size, strides and dtype, wrapped for its
device. Anything else takes the MetaConverter's path.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.parameter.Buffer)


def fake_copy(mode: FakeTensorMode, real: torch.Tensor) -> torch.Tensor:
    """A fake tensor of `mode` with `real`'s size, strides, dtype, device and
    requires_grad (static shapes), a Parameter to isinstance where `real` is one.
    Not memoized: callers keep one per tensor."""
    if not _is_simple(real):
        return mode.from_tensor(real, static_shapes=True)
    with no_dispatch():
        meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
        fake = FakeTensor(mode, meta, real.device)
    if real.requires_grad:
        fake.requires_grad_(True)
    if isinstance(real, torch.nn.Parameter):
        fake._is_param = True  # isinstance(fake, nn.Parameter), as torch's fakes of parameters answer
    return fake


def _is_simple(real: torch.Tensor) -> bool:
    """Dense and strided, a leaf, its own storage from offset 0 and no further, no lazy
    conjugate or negative bit, not an inference tensor: what a fresh empty_strided is."""
    if type(real) not in _PLAIN_TYPES or real.layout != torch.strided or real.is_quantized:
        return False
    if real._base is not None or real.storage_offset() != 0 or not real.is_leaf:
        return False
    if real.is_conj() or real.is_neg() or real.is_inference() or real.device.type == "meta":
        return False
    extent = 1 + sum((n - 1) * s for n, s in zip(real.shape, real.stride())) if real.numel() else 0
    return real.untyped_storage().nbytes() == extent * real.element_size()


def storage_elements(t: torch.Tensor) -> object:
    """The elements of `t`'s storage (a SymInt over symbols): what `meta_on_fresh_storage`
    takes to make another tensor of its layout."""
    return t.untyped_storage().nbytes() // t.element_size()


def meta_on_fresh_storage(elements: object, size, stride, offset, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of `size`, `stride` and `offset` on a fresh storage of `elements`: over
    symbols, as_strided of a 1-d tensor computes next to nothing, where empty_strided computes
    the storage's size from the sizes and strides and checks it, each step a sympy operation
    (bench/DECISIONS.md#rebuild-as-strided). Call under no_dispatch."""
    return torch.as_strided(torch.empty((elements,), dtype=dtype, device="meta"), size, stride, offset)


def over_symbols(mode: FakeTensorMode, env) -> FakeTensorMode:
    """`mode` running its ops over the symbolic sizes of ShapeEnv `env`, without torch's
    fake-result cache: over symbols, building an entry (which checks it by rebuilding the
    result) and rebuilding results from entries cost more than the ops, each size a sympy
    operation; fake_memo replays what a graph repeats (bench/DECISIONS.md#no-fake-cache-over-symbols:
    GPT-2's aten trace 1.0 -> 0.65 s, its 2-layer capture over symbols 4.6 -> 3.4 s, CPU)."""
    mode.shape_env = env
    mode.static_shapes = False
    mode.cache_enabled = False
    return mode
