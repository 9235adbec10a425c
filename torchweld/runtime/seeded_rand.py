"""Uniform random numbers as a function of a seed tensor, so that a training step can draw
dropout's mask in the forward and draw it again in the backward instead of saving it.

`torchweld::seeded_rand(seed, size, dtype)`: the numbers weld's kernels draw for
`torch.rand(size)` from `seed` (a 0-d int64 tensor): Philox4x32-10 with key (seed's low,
high word) at counter (the element's row-major position, 0, 0, 0), its first word made a
float in [0, 1) as Triton's `tl.rand` makes it (codegen/cpp.py's `tw_rand` is the same
function in C++). Half types are kept below 1 once rounded, as `rules.rand` keeps them.

The seed itself comes from `aten.randint(SEED_LOW, SEED_HIGH, [])`, drawn once per step in
the forward (autograd/smaller_saves.py); the backward reads it, 8 bytes, where it read the
mask, a byte an element. The weld backend lowers `seeded_rand` into the kernels that read
it (compiler/rules.py); this implementation, built of aten's integer ops, runs where weld
calls it as an aten op (eagerly, or for a lowering it refuses), and gives the same bits.
"""
from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("torchweld", "FRAGMENT")
_LIBRARY.define("seeded_rand(Tensor seed, SymInt[] size, ScalarType dtype) -> Tensor")

SEED_LOW, SEED_HIGH = -(2**63), 2**63 - 1  # seeds over all of int64: distinct across many steps
# The largest value below 1 of each half type: a draw rounds to it, not up to 1.
BELOW_ONE = {torch.float16: 1 - 2**-11, torch.bfloat16: 1 - 2**-8}


def drawable(val: torch.Tensor) -> bool:
    """Whether weld's kernels draw `val`'s numbers themselves: 32 random bits at a 32-bit
    counter, so float32 or a half type, under 2**31 elements."""
    return val.dtype in (torch.float32, *BELOW_ONE) and val.numel() < 2**31

_WORD = 0xFFFFFFFF
_ROUND_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_TO_UNIT = 4.6566127342e-10  # 2**-31, as Triton's uint_to_uniform_float spells it


def _mul_hi_lo(constant: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of `constant * x` (both below 2**32), in int64 without
    overflow: 16-bit halves multiplied, their carries added."""
    c1, c0 = constant >> 16, constant & 0xFFFF
    x1, x0 = x >> 16, x & 0xFFFF
    middle = x1 * c0 + x0 * c1  # below 2**33
    low = x0 * c0 + ((middle & 0xFFFF) << 16)  # below 2**33
    high = x1 * c1 + (middle >> 16) + (low >> 32)
    return high & _WORD, low & _WORD


def _seeded_rand(seed: torch.Tensor, size, dtype: torch.dtype) -> torch.Tensor:
    if seed.dtype != torch.int64 or seed.dim() != 0:
        raise ValueError(f"seeded_rand takes a 0-d int64 seed, got {seed.dtype} of shape {tuple(seed.shape)}")
    k0, k1 = seed & _WORD, (seed >> 32) & _WORD  # an arithmetic shift: the mask keeps the high word's bits
    c0 = torch.arange(int(torch.Size(size).numel()), dtype=torch.int64, device=seed.device) & _WORD
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        high0, low0 = _mul_hi_lo(_ROUND_MULTIPLIERS[0], c0)
        high2, low2 = _mul_hi_lo(_ROUND_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = high2 ^ c1 ^ k0, low2, high0 ^ c3 ^ k1, low0
        k0, k1 = (k0 + _KEY_STEPS[0]) & _WORD, (k1 + _KEY_STEPS[1]) & _WORD
    # the first word as an int32 x, then (x < 0 ? ~x : x) * 2**-31 in float32
    magnitude = torch.where(c0 >= 2**31, _WORD - c0, c0)
    values = magnitude.to(torch.float32) * torch.tensor(_TO_UNIT, dtype=torch.float32, device=seed.device)
    if dtype in BELOW_ONE:
        values = values.clamp_max(BELOW_ONE[dtype])
    return values.to(dtype).reshape(size)


def _seeded_rand_meta(seed: torch.Tensor, size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=seed.device)


_LIBRARY.impl("seeded_rand", _seeded_rand, "CompositeExplicitAutograd")
# a Meta kernel, which fake tensors run too (see pool_offsets.py on torch.library.register_fake)
_LIBRARY.impl("seeded_rand", _seeded_rand_meta, "Meta")

seeded_rand = torch.ops.torchweld.seeded_rand.default
