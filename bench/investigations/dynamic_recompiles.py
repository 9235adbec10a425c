"""Why a model recompiles across input lengths under dynamic=None: calls a transformers model
(bench/models.py's GPT-2 or BERT) with several sequence lengths under torchweld.compile and
prints the recompile and graph-break log lines and the graph count.

    TORCHWELD_LOGS=recompiles,graph_breaks python bench/investigations/dynamic_recompiles.py --model gpt2 --device cuda
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torchweld  # noqa: E402
from bench.models import BENCHMARKS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--lengths", default="464,229,420,487,247,52")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    case = BENCHMARKS[args.model].make(args.device, args.quick)
    model = case.model.eval()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torchweld.compile(model, backend=counting if args.backend == "eager" else args.backend)
    with torch.no_grad():
        for n in (int(s) for s in args.lengths.split(",")):
            ids = case.inputs[0][:, :1].repeat(1, n)
            before = len(graphs)
            compiled(ids)
            print(f"length {n}: {len(graphs) - before} new graphs", flush=True)
    print(f"{len(graphs)} graphs")


if __name__ == "__main__":
    main()
