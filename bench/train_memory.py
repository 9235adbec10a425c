"""Peak CUDA memory of one warm training step, phase by phase, eager against the compilers.

    python3 bench/train_memory.py resnet50 [eager weld tc]

For a training row of compare.py (resnet50, BERT, GPT-2, densenet121), each compiler in turn
in this process: two steps to warm up (compiles included), then one step measured phase by
phase with the peak statistics reset before each: the forward (peak, and what is still
allocated after it: parameters, Adam state and the saved activations), the loss and backward
(peak, and what is left: the gradients), then Adam. compare.py's peak column covers the cold
step too; this one shows where a warm step's memory goes.
"""
from __future__ import annotations

import sys

import torch

import torchweld
from compare import training_cases

MiB = 2 ** 20


def measure(row: str, make_model, make_batch, loss_fn, compiler: str) -> str:
    torch.manual_seed(0)
    model = make_model().cuda().train()
    x, y = (t.cuda() for t in make_batch())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    f = {"eager": lambda m: m, "weld": lambda m: torchweld.compile(m, backend="weld"),
         "tc": torch.compile}[compiler](model)
    for _ in range(2):
        opt.zero_grad(True)
        loss_fn(f(x), y).backward()
        opt.step()
    opt.zero_grad(True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    phases = []
    torch.cuda.reset_peak_memory_stats()
    out = f(x)
    torch.cuda.synchronize()
    phases.append(("forward", torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()))
    torch.cuda.reset_peak_memory_stats()
    loss = loss_fn(out, y)
    del out
    loss.backward()
    torch.cuda.synchronize()
    phases.append(("backward", torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()))
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    phases.append(("adam", torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()))
    torchweld.reset()
    return (f"{row:24s} {compiler:6s} start {start / MiB:7.0f}  "
            + "  ".join(f"{name} peak {peak / MiB:7.0f} after {after / MiB:7.0f}" for name, peak, after in phases))


def main() -> None:
    name, compilers = sys.argv[1], sys.argv[2:] or ["eager", "weld", "tc"]
    [(row, make_model, make_batch, loss_fn)] = [r for r in training_cases(False, "cuda") if r[0].split()[0] == name]
    print("MiB allocated (torch.cuda.max_memory_allocated / memory_allocated), one warm step")
    for compiler in compilers:
        print(measure(row, make_model, make_batch, loss_fn, compiler), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
