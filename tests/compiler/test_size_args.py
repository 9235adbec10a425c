"""Sizes as kernel arguments: the division by magic number, and which integers become arguments."""
import random

import pytest
import torch

from torchweld.compiler.codegen.size_args import magic_division, packed_division


@pytest.mark.parametrize("d", [2, 3, 5, 7, 16, 96, 100, 128, 1000, 4097, 12345, 2**20 + 3, 2**30 + 1, 2**31 - 1])
def test_magic_division_is_floor_division_for_every_int32_index(d):
    magic, shift = magic_division(d)
    assert 2**31 <= magic < 2**32 and shift >= 0
    packed = packed_division(d)
    assert packed >= 2**31 and (packed & 0xFFFFFFFF, packed >> 32) == (magic, shift)
    unsigned = magic
    rng = random.Random(d)
    ns = [0, 1, d - 1, d, d + 1, 2**31 - 1, 2**31 - 2] + [rng.randrange(2**31) for _ in range(2000)]
    n = torch.tensor(ns, dtype=torch.int64)
    assert torch.equal(((n * unsigned) >> 32) >> shift, n // d)
