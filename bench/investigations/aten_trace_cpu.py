"""Tracing a captured graph to aten: torch's make_fx against weld's own recorder
(compiler/aten_trace.py), on the same graph, in one process, in turns.

    .venv/bin/python bench/investigations/aten_trace_cpu.py [--runs 5]

Rows: transformers' GPT-2 (12 layers, batch 2, 64 tokens) and BERT (batch 2, 64 tokens)
from their default configs, and torchvision's resnet50 (batch 2, 64x64) where torchvision
is installed; inference (no_grad, eval). Prints the median seconds of each tracer, the node
counts, and whether both recorded the same multiset of ops.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torchweld
from torchweld.compiler.aten_graph import DECOMPOSITIONS, to_aten_graph


def cases():
    import transformers

    yield "GPT-2 b2 s64", transformers.GPT2Model(transformers.GPT2Config()).eval(), torch.randint(0, 1000, (2, 64))
    yield "BERT b2 s64", transformers.BertModel(transformers.BertConfig()).eval(), torch.randint(0, 1000, (2, 64))
    try:
        import torchvision
    except ImportError:
        print("torchvision missing: no resnet50 row")
        return
    yield "resnet50 b2 64x64", torchvision.models.resnet50().eval(), torch.randn(2, 3, 64, 64)


def captured(model, x):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torchweld.compile(model, backend=keep)(x)
    return graphs[0]


def with_make_fx(gm, inputs):
    def flat(*args):
        return pytree.tree_leaves(gm(*args))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(x) for x in inputs]
    with mode:
        traced = make_fx(flat, decomposition_table=DECOMPOSITIONS, tracing_mode="real")(*fake)
    traced.graph.eliminate_dead_code()
    return traced


def ops(gm):
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}; median of {args.runs} runs each, in turns")
    print(f"{'case':20s} {'make_fx s':>10s} {'weld s':>8s} {'ratio':>6s} {'nodes':>12s} same ops")
    with torch.no_grad():
        for name, model, x in cases():
            gm, inputs = captured(model, x)
            times = {"make_fx": [], "weld": []}
            for _ in range(args.runs):
                t0 = time.perf_counter()
                theirs = with_make_fx(gm, inputs)
                t1 = time.perf_counter()
                ours = to_aten_graph(gm, inputs).gm
                times["make_fx"].append(t1 - t0)
                times["weld"].append(time.perf_counter() - t1)
            a, b = statistics.median(times["make_fx"]), statistics.median(times["weld"])
            nodes = f"{len(theirs.graph.nodes)}/{len(ours.graph.nodes)}"
            print(f"{name:20s} {a:10.3f} {b:8.3f} {b / a:6.2f} {nodes:>12s} {ops(theirs) == ops(ours)}")


if __name__ == "__main__":
    main()
