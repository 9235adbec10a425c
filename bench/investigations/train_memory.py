"""Peak CUDA memory of a training step, phase by phase, eager against the compilers.

    python3 bench/investigations/train_memory.py resnet50 [eager weld tc] [--mode reduce-overhead]

For a training row of compare.py (resnet50, BERT, GPT-2, densenet121), each compiler in turn
in this process runs three steps. The first (cold: compiles, and under reduce-overhead the
warm-ups and CUDA-graph recordings) and the third (warm) are measured phase by phase, with the
peak statistics reset before each phase: the forward (peak, and what is still allocated after
it: parameters, Adam state and the saved activations), the loss and backward (peak, and what
is left: the gradients), then Adam. compare.py's peak column is the largest of all of them.
Beside each peak allocated, the peak of what the tensors asked for: the difference is the
caching allocator's rounding, which depends on what ran before (one compiler per process
compares compilers alone: `train_memory.py BERT weld`, then `train_memory.py BERT tc`).
After the warm step, the memory each pool holds: the caching allocator's own (`(0, 0)`) and
each CUDA-graph pool, as reserved segments and the part of them allocated. A CUDA graph's
scratch is reserved but not allocated between replays; torch.compile's CUDA graph trees also
count their outputs as unallocated, where weld's recordings keep theirs allocated.
"""
from __future__ import annotations

import argparse
import collections
import gc

import torch

import torchweld
from compare import training_cases

MiB = 2 ** 20


def _phases(f, opt, loss_fn, x, y) -> list[tuple[str, int, int, int]]:
    """One step; (phase, peak bytes, peak bytes the tensors asked for, bytes allocated after
    it) for forward, backward, Adam."""
    opt.zero_grad(True)
    torch.cuda.synchronize()
    phases = []
    torch.cuda.reset_peak_memory_stats()
    out = f(x)
    torch.cuda.synchronize()
    phases.append(("forward", *_peaks()))
    torch.cuda.reset_peak_memory_stats()
    loss = loss_fn(out, y)
    del out
    loss.backward()
    del loss
    torch.cuda.synchronize()
    phases.append(("backward", *_peaks()))
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    phases.append(("adam", *_peaks()))
    return phases


def _peaks() -> tuple[int, int, int]:
    """(peak allocated, peak requested, allocated now): allocated counts each block the caching
    allocator handed out whole (a free block less than 1 MiB larger than a request is not split)."""
    stats = torch.cuda.memory_stats()
    return stats["allocated_bytes.all.peak"], stats["requested_bytes.all.peak"], stats["allocated_bytes.all.current"]


def _pools() -> str:
    """Reserved / allocated MiB of each memory pool, largest first."""
    by_pool = collections.defaultdict(lambda: [0, 0])
    for segment in torch.cuda.memory_snapshot():
        sizes = by_pool[str(segment.get("segment_pool_id"))]
        sizes[0] += segment["total_size"]
        sizes[1] += segment["allocated_size"]
    return "  ".join(f"pool {pool} {reserved / MiB:.0f}/{allocated / MiB:.0f}"
                     for pool, (reserved, allocated) in sorted(by_pool.items(), key=lambda kv: -kv[1][0]))


def measure(row: str, make_model, make_batch, loss_fn, compiler: str, mode: str | None) -> list[str]:
    torch.manual_seed(0)
    model = make_model().cuda().train()
    x, y = (t.cuda() for t in make_batch())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    f = {"eager": lambda m: m, "weld": lambda m: torchweld.compile(m, backend="weld", mode=mode),
         "tc": lambda m: torch.compile(m, mode=mode)}[compiler](model)
    lines = []
    for step in range(1, 4):
        phases = _phases(f, opt, loss_fn, x, y)
        lines.append(f"{row:24s} {compiler:6s} step {step}  "
                     + "  ".join(f"{name} peak {(peak - start) / MiB:6.0f} (asked {(asked - start) / MiB:6.0f}) "
                                 f"after {(after - start) / MiB:6.0f}" for name, peak, asked, after in phases))
    lines.append(f"{row:24s} {compiler:6s} reserved {torch.cuda.memory_reserved() / MiB:.0f} MiB: {_pools()}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="first word of a compare.py training row, e.g. densenet121")
    parser.add_argument("compilers", nargs="*", default=["eager", "weld", "tc"])
    parser.add_argument("--mode", default=None, help="the compilers' mode, e.g. reduce-overhead")
    args = parser.parse_args()
    [(row, make_model, make_batch, loss_fn)] = [r for r in training_cases(False, "cuda")
                                                if r[0].split()[0] == args.case]
    print("MiB allocated (torch.cuda.max_memory_allocated / memory_allocated) above what the model and "
          "its batch hold, per phase of three steps, and the peak of the bytes the tensors asked for "
          f"(requested_bytes); mode={args.mode}")
    for compiler in args.compilers:
        for line in measure(row, make_model, make_batch, loss_fn, compiler, args.mode):
            print(line, flush=True)
        # the compiler's graphs and memory pools go before the next one starts counting
        torchweld.reset()
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
