"""Prints weld's generated wrapper and kernels for bench/decode.py's step (TORCHWELD_LOGS=output_code,+weld
set by the caller), after one call at batch 1."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torchweld  # noqa: E402
from bench.decode import PRESETS, build, decode_step  # noqa: E402

preset = sys.argv[1] if len(sys.argv) > 1 else "0.85b"
device = "cuda" if torch.cuda.is_available() else "cpu"
model = build(PRESETS[preset], 1, device, torch.bfloat16)
step = torchweld.compile(decode_step, backend="weld", fullgraph=True)
with torch.no_grad():
    step(model, torch.zeros(1, 1, dtype=torch.long, device=device), torch.tensor([5], device=device))
