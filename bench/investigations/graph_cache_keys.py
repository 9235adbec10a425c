"""Which part of a graph cache key differs between two processes compiling the same model
(a graph compiled again at every warm start): each process runs one training step (or one
inference call) of a bench/models.py model with the `cache` log at debug level, and this
prints each process's keys and their parts side by side, and any warning the load gave.

    python bench/investigations/graph_cache_keys.py --model gpt2 --device cuda --phase training
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one_run(args) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    import torchweld
    from bench.models import BENCHMARKS

    case = BENCHMARKS[args.model].make(args.device, args.quick)
    compiled = torchweld.compile(case.model.train(args.phase == "training"))
    if args.phase == "training":
        case.loss(compiled(*case.inputs), case.target).backward()
    else:
        with torch.no_grad():
            compiled(*case.inputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--phase", choices=("inference", "training"), default="training")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        one_run(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="torchweld-keys-") as tmp:
        env = dict(os.environ, TORCHWELD_CACHE_DIR=tmp, TORCHWELD_LOGS="+cache", TORCHWELD_GRAPH_CACHE="1")
        for run in (1, 2):
            command = [sys.executable, __file__, "--in-process", "--model", args.model, "--device", args.device,
                       "--phase", args.phase] + (["--quick"] if args.quick else [])
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            print(f"=== process {run} (exit {proc.returncode})")
            for line in proc.stderr.splitlines():
                if re.search(r"graph cache|cannot be used|damaged|Error", line):
                    print(line[:400])
    return 0


if __name__ == "__main__":
    sys.exit(main())
