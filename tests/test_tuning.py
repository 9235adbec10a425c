"""torchweld/tuning.py: one object of tuning constants, read where they are used, so that a
changed field (tuning.patch, or bench/with_constants.py) reaches the code that reads it."""
import dataclasses

import pytest
import torch

import torchweld
from torchweld.tuning import Tuning, tuning


def test_patch_sets_fields_and_restores_them():
    before = dataclasses.asdict(tuning)
    with tuning.patch(max_kernel_members=3, chunk_steps=8):
        assert tuning.max_kernel_members == 3 and tuning.chunk_steps == 8
    assert dataclasses.asdict(tuning) == before
    with pytest.raises(RuntimeError), tuning.patch(max_kernel_members=3):
        raise RuntimeError
    assert dataclasses.asdict(tuning) == before


def test_an_unknown_field_is_an_error_naming_the_known_ones():
    before = dataclasses.asdict(tuning)
    known = "tuning has no field 'max_kernel_member'; its fields: .*max_kernel_members"
    with pytest.raises(ValueError, match=known), tuning.patch(chunk_steps=8, max_kernel_member=3):
        pass
    assert dataclasses.asdict(tuning) == before  # nothing was set


def test_the_module_is_torchweld_tuning_and_its_defaults_are_the_dataclass_defaults():
    assert torchweld.tuning.tuning is tuning and "tuning" in torchweld.__all__
    assert dataclasses.asdict(tuning) == dataclasses.asdict(Tuning())


def test_a_patched_field_reaches_the_code_that_reads_it():
    """schedule reads tuning.max_kernel_members when it groups, not a copy taken at import."""
    from torchweld.compiler import compile_graph

    def fn(x):
        return [torch.tanh(x + i) for i in range(6)]

    x = torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(fn)
    with torch.no_grad():
        assert len(compile_graph(gm, [x]).schedule.kernels()) == 1
        with tuning.patch(max_kernel_members=2):
            compiled = compile_graph(gm, [x])
            assert len(compiled.schedule.kernels()) == 3
        torch.testing.assert_close(compiled(x), fn(x))
