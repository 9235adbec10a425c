"""Steady-state GPU memory of the tutorial's train step, one compiler per process.

    python3 bench/investigations/train_step_memory.py [--compiler eager|weld] [--model densenet121] [--batch 16] [--size 128]

One step = opt.zero_grad(True); CrossEntropyLoss(model(x), y).backward(); opt.step() with Adam,
float32, CUDA; with --compiler weld the whole step function is compiled by torchweld. After 3
warm-up steps (compile included) the peak is reset, and 5 more steps give the steady-state peak
(torch.cuda.max_memory_allocated) and what stays allocated between steps (parameters, gradients,
Adam's state). A process of its own, so nothing another compiler left behind is counted.
"""
from __future__ import annotations

import argparse

import torch
import torchvision

import torchweld


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compiler", default="weld", choices=["eager", "weld"])
    parser.add_argument("--model", default="densenet121")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(args.batch, 3, args.size, args.size, device="cuda")
    y = torch.randint(0, 1000, (args.batch,), device="cuda")

    def train(x, y):
        opt.zero_grad(True)
        loss = torch.nn.CrossEntropyLoss()(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step = torchweld.compile(train) if args.compiler == "weld" else train
    for _ in range(3):
        step(x, y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    for _ in range(5):
        step(x, y)
    torch.cuda.synchronize()
    print(f"{args.model} b{args.batch} 3x{args.size}x{args.size}, {args.compiler}: steady-state peak "
          f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB, held between steps {held / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
