"""bench/dynamic_sizes.py stays runnable: a tiny GPT-2 over a few sequence lengths on the CPU,
torchweld with dynamic=None and dynamic=False beside eager, each in a fresh process with empty
caches, for inference and for training steps; the record's fields, the compile counts, and the
outputs against eager's (issue 45)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILERS = ("eager", "torchweld", "torchweld-static")


def run_bench(records_dir: Path, *args: str) -> dict:
    cmd = [sys.executable, "bench/dynamic_sizes.py", "--model", "gpt2", "--device", "cpu", "--quick",
           "--compilers", ",".join(COMPILERS), "--min-len", "32", "--max-len", "128", "--calls", "1", "--rounds", "1",
           "--records-dir", str(records_dir), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [record] = [json.loads(line) for line in (records_dir / "dynamic_sizes.jsonl").read_text().splitlines()]
    return record


@pytest.fixture(scope="module")
def inference(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("records"), "--lengths", "4")


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("records"), "--phase", "training", "--lengths", "3")


def check_common(record: dict, phase: str, count: int) -> dict:
    """The fields every record of these runs has; returns figures["compilers"]."""
    assert record["bench"] == "dynamic_sizes" and record["source"] == "run"
    for key in ("commit", "host", "cpu", "cores", "python", "versions", "command", "date"):
        assert record[key], key
    assert record["gpu"] is None and "bench/dynamic_sizes.py" in record["command"]
    label = "GPT-2 b8 tiny d64 2 layers" + (", no dropout" if phase == "training" else "")
    assert record["row"] == {"model": "gpt2", "label": label, "phase": phase, "device": "cpu", "batch": 8,
                             "dtype": "float32", "lengths": count, "min_len": 32, "max_len": 128}
    lengths = record["figures"]["lengths"]
    assert len(lengths) == len(set(lengths)) == count and all(32 <= n <= 128 for n in lengths)
    figures = record["figures"]["compilers"]
    assert list(figures) == list(COMPILERS)
    for name, f in figures.items():
        assert "error" not in f, (name, f)
        assert set(f["per_length"]) == {str(n) for n in lengths}
        assert f["total_s"] == pytest.approx(sum(p["pass_s"] for p in f["per_length"].values()))
        assert f["first_compile_s"] == f["per_length"][str(lengths[0])]["pass_s"] > 0
        for n, per in f["per_length"].items():
            assert per["ms"] > 0 and len(per["rounds_ms"]) == 1, (name, n)
            assert per["max_diff"] < 1e-4, (name, n, per)  # the output against eager's
            if phase == "training":
                assert per["loss_diff"] < 1e-4, (name, n, per)
        assert f["max_diff"] == max(p["max_diff"] for p in f["per_length"].values())
        assert f["graphs_in_steady"] == 0  # nothing compiled after the pass

    eager, dynamic, static = figures["eager"], figures["torchweld"], figures["torchweld-static"]
    assert eager["graphs"] == 0 and eager["dynamic_compile_s"] is None
    # dynamic=False: a static graph per length, each compiled by weld once
    assert static["graphs"] == static["weld_compiles"] == count and static["symbolic_graphs"] == 0
    assert static["dynamic_compile_s"] is None
    # dynamic=None: the first length a static graph, the second a symbolic one; weld compiles the
    # symbolic graph, inference or training, once over its symbols (backends/weld_symbolic.py)
    first, second = (dynamic["per_length"][str(n)] for n in lengths[:2])
    assert first["new_graphs"] == 1 and second["new_graphs"] == 1 and dynamic["symbolic_graphs"] >= 1
    assert dynamic["dynamic_compile_len"] == lengths[1] and dynamic["dynamic_compile_s"] == second["pass_s"]
    assert dynamic["weld_compiles"] == 2, dynamic
    assert dynamic["weld_compiles_in_steady"] == 0
    ratios = [dynamic["per_length"][str(n)]["ratio_to_static"] for n in lengths]
    assert dynamic["mean_ratio_to_static"] == pytest.approx(sum(ratios) / count)
    assert all(r > 0 for r in ratios) and "mean_ratio_to_static" not in static
    return figures


def test_inference_record_and_outputs(inference):
    check_common(inference, "inference", 4)


def test_training_record_and_outputs(training):
    check_common(training, "training", 3)


@pytest.mark.parametrize("phase", ["inference", "training"])
def test_dynamic_none_compiles_at_most_twice(phase, request):
    """Issue 45: under dynamic=None the first length compiles a static graph, the second a graph
    with the length symbolic, and no later length (all >= 2) compiles again."""
    record = request.getfixturevalue(phase)
    dynamic = record["figures"]["compilers"]["torchweld"]
    assert dynamic["graphs"] <= 2 and dynamic["symbolic_graphs"] == 1, dynamic
    for n in record["figures"]["lengths"][2:]:
        assert dynamic["per_length"][str(n)]["new_graphs"] == 0, n
