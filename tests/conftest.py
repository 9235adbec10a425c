import pytest
import torch

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
