"""What a torchvision model's cold compile has to do, counted on any machine (no GPU needed):
the Triton compiles each graph needs (distinct function, launch configuration and integer
specialization: what the compile workers get), with and without chained concatenations
(compiler/cat_chains.py, options={"chain_concatenations": False}).

    python3 bench/investigations/compile_counts.py densenet121 [--train] [--shape 32 3 224 224]

Inference: the model in eval under no_grad, one graph. --train: the model in train mode, its
joint graph partitioned (min-cut) into the forward and backward graphs weld compiles. The
Triton kernels are rendered for the CPU tensors of the example (the same kernels as on CUDA
but for the device in their launch); nothing is compiled or run. Each line also gives the CPU
seconds of this machine's joint trace (training), lowering, scheduling and rendering, with the
garbage collector off as during a compile.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch
import torchvision

import torchweld
from torchweld.autograd.joint import module_state, trace_joint
from torchweld.autograd.partition import partition
from torchweld.backends.weld import prepare
from torchweld.compiler.aten_graph import to_aten_graph, traced_aten_graph
from torchweld.compiler.codegen.triton import TritonRenderer, int_classes, launch_config
from torchweld.compiler.lowering import GraphLowering
from torchweld.compiler.schedule import schedule


def captured(model: torch.nn.Module, x: torch.Tensor, train: bool):
    """(graph, example inputs) of the model's one graph."""
    graphs = []
    with torch.set_grad_enabled(train):
        torchweld.compile(model, backend=lambda gm, example_inputs: graphs.append((gm, example_inputs)) or gm.forward)(x)
    (gm, example_inputs), = graphs
    return gm, example_inputs


def compile_keys(aten_gm: torch.fx.GraphModule, inputs: list, seconds: dict) -> tuple[int, int, int]:
    """(kernel launches, distinct Triton compiles, most buffers one kernel reads) of an aten
    graph; the seconds of its lowering, scheduling and rendering go into `seconds`."""
    start = time.perf_counter()
    lowering = GraphLowering(aten_gm, check=lambda buf: None, bias_in_kernel=lambda d: True,
                             split_reductions=lambda d: True)
    lowered = lowering.run(list(inputs), None)
    seconds["lower"] = time.perf_counter() - start
    sched = schedule(lowered)
    seconds["schedule"] = time.perf_counter() - start - seconds["lower"]
    kernels = sched.kernels()
    dtypes = {name: dtype for name, (dtype, _, _) in sched.layouts.items()}
    keys = {(fn, tuple(sorted(launch_config(k).items())), int_classes(k))
            for k, fn, _ in TritonRenderer().render_modules(kernels, dtypes)}
    seconds["render"] = time.perf_counter() - start - seconds["lower"] - seconds["schedule"]
    return len(kernels), len(keys), max(len(k.reads) for k in kernels)


def graphs(gm, example_inputs, train: bool, chain: bool, seconds: dict | None = None) -> dict:
    """{"inference" | "forward" | "backward": (aten graph, its inputs)}, as the weld backend
    builds them; the joint trace's seconds go into `seconds` ("joint")."""
    gm = prepare(gm, {"chain_concatenations": chain}, inference=not train)
    if not train:
        return {"inference": (to_aten_graph(gm, example_inputs).gm, example_inputs)}
    state = module_state(gm)
    primals = [s.read(gm) for s in state] + [a for a in example_inputs if isinstance(a, torch.Tensor)]
    start = time.perf_counter()
    joint = trace_joint(gm, state, primals)
    if seconds is not None:
        seconds["joint"] = time.perf_counter() - start
    part = partition(joint, "min_cut")
    backward_inputs = [n.meta["val"] for n in part.backward.graph.nodes if n.op == "placeholder"]
    return {"forward": (traced_aten_graph(part.forward).gm, primals),
            "backward": (traced_aten_graph(part.backward).gm, backward_inputs)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a torchvision.models constructor, e.g. densenet121")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--shape", type=int, nargs=4, default=[16, 3, 128, 128], help="the input's shape")
    args = parser.parse_args()
    model = getattr(torchvision.models, args.model)().train(args.train)
    x = torch.randn(*args.shape)
    for chain in (False, True):
        gm, example_inputs = captured(model, x, args.train)
        print(f"{args.model} {'train' if args.train else 'eval'}, concatenations {'chained' if chain else 'as written'}:")
        gc.collect()
        gc.disable()
        seconds: dict = {}
        for name, (aten_gm, inputs) in graphs(gm, example_inputs, args.train, chain, seconds).items():
            launches, keys, reads = compile_keys(aten_gm, inputs, seconds)
            times = ", ".join(f"{phase} {s:.3f} s" for phase, s in seconds.items())
            print(f"  {name:9s} {launches:4d} launches, {keys:4d} Triton compiles, at most {reads} inputs a "
                  f"kernel; {times}")
            seconds.pop("joint", None)
        gc.enable()
        torchweld.reset()


if __name__ == "__main__":
    main()
