"""max-autotune for matrix multiplies: each aten mm/bmm extern of a schedule is
timed against the Triton matmul template (runtime/triton_matmul.py) on its real
shapes, and replaced by the template where that is faster. Choices are kept in
`<cache_dir>/autotune/matmul.tune.json`, keyed by device, op, shapes, strides, dtype."""
from __future__ import annotations

import torch

from torchweld.compiler import ir
from torchweld.compiler.schedule import ExternCall, Schedule
from torchweld.runtime.autotune import Autotuner, device_name, synthetic_tensor
from torchweld.disk_cache import entry_folder

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.bmm.default)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def choose_matmuls(sched: Schedule, options: dict, on_triton) -> list[str]:
    """Swap the faster implementation into each mm/bmm extern that `on_triton(device)` accepts;
    return one line per choice (for logs and tests)."""
    import os

    from torchweld.runtime.triton_matmul import CONFIGS, TritonMatmul

    tuner = options.get("autotuner") or Autotuner(options.get("autotune_timer"))
    path = os.path.join(entry_folder("autotune"), "matmul.tune.json")
    lines = []
    for step in sched.steps:
        if not isinstance(step, ExternCall):
            continue
        ext = sched.graph.buffers[step.name]
        if ext.target not in MATMULS or ext.kwargs or not on_triton(ext.device):
            continue
        layouts = [_layout_of(sched, a) for a in ext.args]
        if len(layouts) != 2 or None in layouts or layouts[0][0] not in DTYPES or layouts[0][0] != layouts[1][0]:
            continue
        args = [synthetic_tensor(*layout) for layout in layouts]
        candidates = [{"impl": "aten"}] + [{"impl": "triton", "config": list(c)} for c in CONFIGS]

        def run(config: dict, target=ext.target, args=args):
            return target(*args) if config["impl"] == "aten" else TritonMatmul(config["config"])(*args)

        tf32 = torch.backends.cuda.matmul.allow_tf32
        key = (f"{device_name(ext.device)}/{ext.target}/{[tuple(a.shape) for a in args]}/"
               f"{[a.stride() for a in args]}/{args[0].dtype}/tf32={tf32}")
        best = tuner.choose(path, key, candidates, run)
        if best["impl"] == "triton":
            ext.target = TritonMatmul(best["config"])
        lines.append(f"{step.name}: {key} -> {best}")
    return lines


def _layout_of(sched: Schedule, arg: object):
    if not isinstance(arg, ir.TensorArg):
        return None
    dtype, _, device = sched.layouts[arg.buffer]
    return dtype, arg.layout, device
