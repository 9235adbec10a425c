import os

import pytest
import torch

# Triton's interpreter runs generated Triton kernels on CPU tensors. Triton reads
# TRITON_INTERPRET when it is imported, so it is set here, before any test module
# imports triton - and only without CUDA: on a GPU machine it would send every
# kernel, CUDA graphs' included, through the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Tests look inside compiled graphs (their schedule, the phases and logs of a compile), which a
# graph loaded from the graph cache does not have: it is off here, but in the tests that turn
# it on (tests/compiler/test_graph_cache.py).
os.environ.setdefault("TORCHWELD_GRAPH_CACHE", "0")

import torchweld


@pytest.fixture(autouse=True)
def fresh_state():
    torchweld.reset()
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def surface_capture_bugs():
    with torchweld.config.patch(raise_internal_errors=True):
        yield


@pytest.fixture(autouse=True)
def grad_mode_is_left_as_found(request):
    """A compiled call (or its compilation) must never leave grad mode changed."""
    yield
    assert torch.is_grad_enabled(), f"{request.node.name} left grad mode disabled"
