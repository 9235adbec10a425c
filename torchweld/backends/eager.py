"""The `eager` backend: run the captured graph's own Python code, op by op."""
from __future__ import annotations

import torch

from torchweld.backends import register_backend


@register_backend("eager")
def eager(gm: torch.fx.GraphModule, example_inputs: list):
    return gm.forward
