"""Column sums (a reduction whose rows are read across, contiguous along its outputs): weld's
block shapes against torch.compile's kernels, on the shapes of a GPT-2 training step's bias
gradients (8192 rows of 3072 and of 768 columns, bfloat16 and float32).

    python bench/investigations/column_sums.py [--device cuda] [--xblocks 64,128,256] [--iters 200]

For each shape and dtype: eager, torch.compile, and weld with each `tuning.outer_xblock` given
(the widest block of outputs such a reduction takes; 64 by default), in one process, each
timed with CUDA events over --iters calls after a warm-up (median of 5 rounds, microseconds).
An investigation's output, printed: not a record.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torchweld  # noqa: E402
from torchweld.tuning import tuning  # noqa: E402


def column_sum(g: torch.Tensor) -> torch.Tensor:
    return g.float().sum(0)


def timed_us(fn, x: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        fn(x)
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--xblocks", default="8,16,32,64,128,256")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    xblocks = [int(x) for x in args.xblocks.split(",")]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; microseconds a call")
    print(f"{'shape':>12s} {'dtype':>9s} {'eager':>8s} {'tc':>8s} " + " ".join(f"{'xb' + str(x):>8s}" for x in xblocks))
    for cols in (3072, 768):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(8192, cols, device=args.device, dtype=dtype)
            want = column_sum(x)
            row = [timed_us(column_sum, x, args.iters)]
            torch._dynamo.reset()
            row.append(timed_us(torch.compile(column_sum), x, args.iters))
            for xblock in xblocks:
                torchweld.reset()
                with tuning.patch(outer_xblock=xblock):
                    compiled = torchweld.compile(column_sum)
                    got = compiled(x)
                    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-3)
                    row.append(timed_us(compiled, x, args.iters))
            print(f"{'8192x' + str(cols):>12s} {str(dtype)[6:]:>9s} " + " ".join(f"{t:8.1f}" for t in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
