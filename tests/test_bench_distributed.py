"""bench/distributed.py stays runnable: its quick rows (a tiny GPT-2 under DDP, a tiny Llama under
FSDP2 with bfloat16 parameters) on 2 gloo ranks of the CPU, eager and torchweld each in fresh
processes, append one record a row; torchweld's first losses match eager's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.timeout(240),
]


def test_quick_rows_on_two_gloo_ranks_record_figures_and_eager_losses(tmp_path):
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "bench/distributed.py", "--device", "cpu", "--nproc", "2", "--quick",
                           "--only", "ddp_gpt2,fsdp_llama", "--compilers", "eager,torchweld", "--warmup", "2",
                           "--steps", "2", "--timeout", "120", "--records-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "distributed.jsonl").read_text().splitlines()]
    assert [r["row"]["model"] for r in records] == ["ddp_gpt2", "fsdp_llama"]
    for record, parallel, dtype, tolerance in zip(records, ("DDP", "FSDP2"), ("float32", "bfloat16"), (1e-5, 2e-3)):
        assert record["bench"] == "distributed" and record["source"] == "run" and record["gpu"] is None
        assert "bench/distributed.py" in record["command"] and "--only ddp_gpt2,fsdp_llama" in record["command"]
        row = record["row"]
        assert row == {"model": row["model"], "label": row["label"], "parallel": parallel, "world_size": 2,
                       "device": "cpu", "dtype": dtype}
        assert row["label"].startswith(parallel) and row["label"] in proc.stdout
        eager, weld = record["figures"]["compilers"]["eager"], record["figures"]["compilers"]["torchweld"]
        assert "error" not in eager and "error" not in weld, (eager, weld)
        for f in (eager, weld):
            assert f["cold_s"] == max(f["cold_s_ranks"]) and len(f["cold_s_ranks"]) == 2
            assert f["steps"] == 2 and f["steps_per_s"] > 0 and len(f["losses"]) == 3
            assert f["samples_per_s"] == f["steps_per_s"] * 2 * 2  # batch 2 on each of 2 ranks
            assert "peak_mib" not in f and "scaling" not in f  # CUDA only; --scaling only
        assert eager["max_diff"] == 0.0 and eager["speedup"] == 1.0
        assert weld["speedup"] == weld["steps_per_s"] / eager["steps_per_s"]
        assert weld["max_diff"] == max(abs(a - b) for a, b in zip(weld["losses"], eager["losses"]))
        assert weld["max_diff"] <= tolerance * abs(eager["losses"][0]), (weld["losses"], eager["losses"])
        assert eager["losses"][2] < eager["losses"][0]  # it trains
