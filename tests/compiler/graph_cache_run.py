"""One process of tests/compiler/test_graph_cache.py: compile a small model with weld, call it
three times (inputs changed between calls; `--case state`: then a weight changed in place,
then a LayerNorm's eps; `--case symbolic`: a function over symbolic sizes, called at --lengths;
`--case symbolic_train`: a training step over symbolic lengths (`--triton-int32-limit N`: in Triton
kernels that assume 32-bit indices for at most N elements); `--case passes`: a model weld's FX
passes rewrite, then a weight changed in place and an attribute its forward reads) against eager, and print as JSON the largest
difference, whether the graph cache loaded or stored an entry, and the compile phases.

    python tests/compiler/graph_cache_run.py --case mlp --seed 0 --eps 1e-5 --batch 4 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if sys.argv.count("triton") or sys.argv.count("symbolic") or sys.argv.count("--triton-int32-limit"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import torchweld  # noqa: E402


def model(args) -> nn.Module:
    torch.manual_seed(args.seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32, eps=args.eps), nn.GELU(), nn.Dropout(0.0),
                         nn.Linear(32, 8)).to(getattr(torch, args.dtype))


class Rewritten(nn.Module):
    """What weld's torch-level passes rewrite (compiler/pipeline.py): a convolution (channels-last,
    oneDNN's on the CPU) and softmax(q @ k^T * scale) @ v (one attention call)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.scale = 0.25

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(2)  # (b, 8, 36)
        attention = torch.softmax(h @ h.transpose(-2, -1) * self.scale, dim=-1)
        return attention @ h


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("mlp", "state", "train", "triton", "frame_constant", "step", "dropout", "empty_buffer", "symbolic", "passes",
                                               "symbolic_train"),
                        default="mlp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eps", type=float, default=1e-5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", default="5,9", help="symbolic: the row lengths of the calls")
    parser.add_argument("--triton-int32-limit", type=int, default=None,
                        help="symbolic_train: Triton kernels, with 32-bit indices up to this many elements")
    parser.add_argument("--scale", type=float, default=2.0)
    parser.add_argument("--frozen", action="store_true", help="train: the first layer's weight requires no grad")
    parser.add_argument("--other-backward-layouts", action="store_true",
                        help="train: the first backward's inputs seem laid out unlike the training entry says")
    args = parser.parse_args()
    if args.other_backward_layouts:
        from torchweld.autograd import training_cache

        training_cache.layouts = lambda tensors: ["not the layouts the entry holds"]
    dtype = getattr(torch, args.dtype)
    eager, compiled_model = model(args), model(args)
    diffs = []
    if args.case == "step":  # a whole step compiled: batch norm's buffers and SGD's momentum written in place
        def with_norm():
            torch.manual_seed(args.seed)
            return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))

        eager, compiled_model = with_norm(), with_norm()
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, compiled_model)]

        def step(model, opt, x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        compiled_step = torchweld.compile(step)
        for i in range(3):
            x = torch.randn(args.batch, 16, dtype=dtype) * (i + 1)
            diffs.append((compiled_step(compiled_model, optimizers[1], x) - step(eager, optimizers[0], x)).abs().item())
            diffs += [(a - b).abs().max().item() for a, b in zip(compiled_model.state_dict().values(),
                                                                 eager.state_dict().values())]
    elif args.case == "train":
        if args.frozen:
            for m in (eager, compiled_model):
                m[0].weight.requires_grad_(False)
        step = torchweld.compile(compiled_model)
        for i in range(3):
            x = torch.randn(args.batch, 16, dtype=dtype) * (i + 1)
            step(x).pow(2).sum().backward()
            eager(x).pow(2).sum().backward()
            for a, b in zip(compiled_model.parameters(), eager.parameters()):
                assert (a.grad is None) == (b.grad is None)
                if a.grad is not None:
                    diffs.append((a.grad - b.grad).abs().max().item())
    elif args.case == "dropout":  # random draws in a training graph: fresh at each call, loaded or not
        torch.manual_seed(args.seed)
        layer = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5))
        compiled = torchweld.compile(layer)
        masks = []
        for i in range(3):
            layer.zero_grad()
            y = compiled(torch.randn(args.batch, 16, dtype=dtype))
            y.sum().backward()
            kept = (y != 0).to(dtype)  # dropout's mask, read off its output
            masks.append(kept)
            diffs.append((layer[0].bias.grad - (kept * 2).sum(0)).abs().max().item())
        diffs.append(float(torch.equal(masks[0], masks[1])))  # the same mask twice: baked, not drawn
    elif args.case == "empty_buffer":  # a module's own empty tensor, returned: that very object
        class WithEmpty(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("empty", torch.zeros(0))

            def forward(self, x):
                return x * 2, self.empty

        holder = WithEmpty()
        compiled = torchweld.compile(holder)
        with torch.no_grad():
            for i in range(3):
                x = torch.randn(args.batch, 16, dtype=dtype)
                out, empty = compiled(x)
                diffs += [(out - x * 2).abs().max().item(), float(empty is not holder.empty)]
    elif args.case == "symbolic":  # a graph over symbolic sizes, whose Triton kernels assume 32-bit indices
        from torchweld.compiler.codegen import triton

        triton.INT32_LIMIT = 4096  # (lowered: a guard that small sizes meet and large ones do not)

        def rows(x):
            return x.sum(-1) * 2, x.amax(-1)

        compiled = torchweld.compile(rows, dynamic=True, options={"cpu_codegen": "triton"})
        for n in map(int, args.lengths.split(",")):
            x = torch.randn(3, n, dtype=dtype)
            diffs += [(a - b).abs().max().item() for a, b in zip(compiled(x), rows(x))]
    elif args.case == "symbolic_train":  # forward and backward over symbols; the backward takes the batch as an int
        class Positions(nn.Module):
            def __init__(self):
                super().__init__()
                self.positions, self.proj = nn.Embedding(64, 16), nn.Linear(16, 16)

            def forward(self, x):
                b, t, d = x.shape
                h = x + self.positions(torch.arange(t))
                return self.proj(h.reshape(b * t, d)).tanh()

        torch.manual_seed(args.seed)
        eager = Positions()
        compiled_model = Positions()
        compiled_model.load_state_dict(eager.state_dict())
        options = None
        if args.triton_int32_limit is not None:  # (lowered: a guard that small sizes meet and large ones do not)
            from torchweld.compiler.codegen import triton

            triton.INT32_LIMIT = args.triton_int32_limit
            options = {"cpu_codegen": "triton"}
        step = torchweld.compile(compiled_model, dynamic=True, options=options)
        for n in map(int, args.lengths.split(",")):
            x = torch.randn(2, n, 16, dtype=dtype)
            step(x).square().sum().backward()
            eager(x).square().sum().backward()
            for a, b in zip(compiled_model.parameters(), eager.parameters()):
                diffs.append((a.grad - b.grad).abs().max().item())
                a.grad = b.grad = None
    elif args.case == "passes":  # keyed before the FX passes: loaded, they are not run again
        torch.manual_seed(args.seed)
        eager, compiled_model = Rewritten().eval(), Rewritten().eval()
        compiled_model.load_state_dict(eager.state_dict())
        compiled = torchweld.compile(compiled_model)
        with torch.no_grad():
            for i in range(5):
                if i == 3:  # a weight changed in place under the (perhaps loaded) graph
                    for m in (eager, compiled_model):
                        m.conv.weight.mul_(-2.0)
                if i == 4:  # an attribute the forward reads: a guard fails, compiled again
                    for m in (eager, compiled_model):
                        m.scale = 0.5
                x = torch.randn(args.batch, 3, 6, 6) * (i + 1)
                diffs.append((compiled(x) - eager(x)).abs().max().item())
    elif args.case == "frame_constant":  # a tensor made in the frame from numbers: its values are in the graph
        def fn(x):
            return compiled_model(x) * torch.tensor([args.scale, 1.0, 0.5, 3.0, 1.0, 1.0, 1.0, 1.0])

        compiled = torchweld.compile(fn)
        with torch.no_grad():
            for i in range(3):
                x = torch.randn(args.batch, 16, dtype=dtype) * (i + 1)
                diffs.append((compiled(x) - eager(x) * torch.tensor([args.scale, 1.0, 0.5, 3.0, 1.0, 1.0, 1.0, 1.0]))
                             .abs().max().item())
    else:
        options = {"cpu_codegen": "triton"} if args.case == "triton" else None
        compiled = torchweld.compile(compiled_model.eval(), options=options)
        eager.eval()
        with torch.no_grad():
            for i in range(5 if args.case == "state" else 3):
                if i == 3:  # the program's state changed under a (perhaps loaded) graph: a weight in place
                    for m in (eager, compiled_model):
                        m[0].weight.mul_(-2.0)
                if i == 4:  # and a module setting, which its guards and the entry's key hold
                    for m in (eager, compiled_model):
                        m[1].eps = 0.5
                x = torch.randn(args.batch, 16, dtype=dtype) * (i + 1)
                diffs.append((compiled(x) - eager(x)).abs().max().item())
    phases = torchweld.compile_times()
    from torchweld import timing

    pass_runs = timing.snapshot().get("weld.pass.fuse_attention", (0, 0.0))[0]
    print(json.dumps({"max_diff": max(diffs), "loaded": "weld.graph_cache.load" in phases, "pass_runs": pass_runs,
                      "lowered": "weld.lower" in phases, "traced": "weld.joint_graph" in phases,
                      "phases": sorted(phases)}))


if __name__ == "__main__":
    main()
