"""Where a cold training compile's lowering and scheduling go, on the CPU.

    .venv/bin/python bench/investigations/profile_lowering_cpu.py [--layers 12] [--sort tottime] [--top 30]

Compiles a transformers GPT-2 (default config, batch 2, 64 tokens) for training with
weld in a fresh cache, its backward at the first backward (not ahead, in a thread), with
cProfile on only while `GraphLowering.run` and `schedule` run; prints
`torchweld.compile_times()` and the top functions. Needs `transformers`.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile

import torch

import torchweld
from torchweld import config
from torchweld.compiler import driver, lowering


def profiled(profiler: cProfile.Profile, fn):
    def wrapper(*args, **kwargs):
        profiler.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            profiler.disable()
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    import transformers

    profiler = cProfile.Profile()
    lowering.GraphLowering.run = profiled(profiler, lowering.GraphLowering.run)
    driver.schedule = profiled(profiler, driver.schedule)
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=args.layers)).train()
    x = torch.randint(0, 50257, (2, 64))
    with tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
        compiled = torchweld.compile(model, backend="weld", options={"backward_ahead": False})
        compiled(x).last_hidden_state.square().mean().backward()
    print(torchweld.compile_times("str"))
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(args.sort).print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
