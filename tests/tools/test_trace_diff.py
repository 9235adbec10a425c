"""Tests of torchweld.tools.trace_diff on traces recorded here with torch.profiler, and on hand-made ones."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity

from torchweld.tools import trace_diff
from torchweld.tools.trace_diff import (
    COLUMNS,
    OpsDiff,
    TraceDiff,
    TraceDiffError,
    compare_traces,
    load_trace_set,
    ops_diff,
    top_differences,
    visualize_counts_diff,
    visualize_duration_diff,
    write_html_report,
)

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 2


def record_trace(fn, path: Path, iterations: int = ITERATIONS) -> Path:
    """Run fn once to warm up, then `iterations` times under torch.profiler; export (.json or .json.gz)."""
    with torch.no_grad():
        fn()
        with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(iterations):
                fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def write_trace(path: Path, events: list[tuple[str, str, float]], *, bare_list: bool = False) -> Path:
    """A hand-made Chrome trace: (name, category, duration µs) complete events plus some noise."""
    trace_events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]
    for i, (name, cat, dur) in enumerate(events):
        trace_events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": 10.0 * i, "dur": dur})
    trace_events.append({"ph": "X", "cat": "python_function", "name": "forward", "ts": 0, "dur": 99})
    trace_events.append({"ph": "s", "cat": "ac2g", "name": "flow", "id": 1, "ts": 0})
    path.write_text(json.dumps(trace_events if bare_list else {"traceEvents": trace_events}))
    return path


# -- real traces: hand fusion and a removed layer --------------------------------------------


@pytest.fixture(scope="module")
def fusion_traces(tmp_path_factory) -> tuple[Path, Path]:
    """x*y + z as two ops (control) against one torch.addcmul (test)."""
    directory = tmp_path_factory.mktemp("fusion")
    x, y, z = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    control = record_trace(lambda: torch.add(torch.mul(x, y), z), directory / "eager.json")
    test = record_trace(lambda: torch.addcmul(z, x, y), directory / "fused.json")
    return control, test


def test_hand_fusion_shows_exactly_the_fused_ops(fusion_traces):
    diff = ops_diff(*fusion_traces)
    assert diff == OpsDiff(added=("aten::addcmul",), deleted=("aten::add", "aten::mul"), increased=(), decreased=(), unchanged=())


def test_ops_diff_is_a_mapping_as_htas_dict_is(fusion_traces):
    diff = ops_diff(*fusion_traces)
    assert diff["added"] == ("aten::addcmul",) and diff["deleted"] == ("aten::add", "aten::mul")
    assert list(diff) == ["added", "deleted", "increased", "decreased", "unchanged"] and len(diff) == 5
    assert dict(diff) == {"added": ("aten::addcmul",), "deleted": ("aten::add", "aten::mul"), "increased": (),
                          "decreased": (), "unchanged": ()}
    assert "added" in diff and "nope" not in diff and diff.get("nope") is None
    with pytest.raises(KeyError):
        diff["nope"]


def test_compare_traces_counts_and_durations(fusion_traces):
    df = compare_traces(*fusion_traces)
    assert list(df.columns) == list(COLUMNS)
    assert df.index.name == "name"
    assert sorted(df.index) == ["aten::add", "aten::addcmul", "aten::mul"]
    assert (df["category"] == "cpu_op").all()
    mul, addcmul = df.loc["aten::mul"], df.loc["aten::addcmul"]
    assert (mul.control_counts, mul.test_counts, mul.diff_counts) == (ITERATIONS, 0, -ITERATIONS)
    assert (addcmul.control_counts, addcmul.test_counts, addcmul.diff_counts) == (0, ITERATIONS, ITERATIONS)
    assert mul.control_duration > 0 and mul.test_duration == 0 and mul.diff_duration == -mul.control_duration
    assert addcmul.diff_duration == addcmul.test_duration > 0
    assert df.attrs == {"control": str(fusion_traces[0]), "test": str(fusion_traces[1])}


def test_directories_of_gzipped_traces_show_the_removed_layer(tmp_path):
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    fewer = nn.Sequential(full[0], full[2])  # the same model with its ReLU removed
    x = torch.randn(4, 8)
    for rank in range(2):  # one trace per rank in each directory
        record_trace(lambda: full(x), tmp_path / "control" / f"rank{rank}.pt.trace.json.gz")
        record_trace(lambda: fewer(x), tmp_path / "test" / f"rank{rank}.pt.trace.json.gz")
    with gzip.open(next((tmp_path / "control").iterdir())) as stream:  # really gzipped
        assert "traceEvents" in json.load(stream)
    trace_set = load_trace_set(tmp_path / "control")
    assert [t.path.name for t in trace_set.traces] == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]

    diff = ops_diff(tmp_path / "control", tmp_path / "test")
    assert (diff.added, diff.deleted, diff.increased, diff.decreased) == ((), ("aten::clamp_min", "aten::relu"), (), ())
    assert "aten::addmm" in diff.unchanged and "aten::linear" in diff.unchanged
    df = compare_traces(trace_set, tmp_path / "test")  # a loaded TraceSet or a path
    assert df.loc["aten::relu", "control_counts"] == 2 * ITERATIONS  # summed over both ranks
    assert df.loc["aten::linear", "control_counts"] == df.loc["aten::linear", "test_counts"] == 2 * 2 * ITERATIONS


def test_torchweld_compile_removes_or_fuses_eager_ops(tmp_path):
    torchweld = pytest.importorskip("torchweld")
    if not hasattr(torchweld, "compile"):
        pytest.skip("torchweld.compile is not written yet")

    def model(x):
        return (x.sin() * 2 + 1).relu()

    compiled = torchweld.compile(model, backend="weld")
    x = torch.randn(64, 64)
    torch.testing.assert_close(compiled(x), model(x))
    control = record_trace(lambda: model(x), tmp_path / "eager.json")
    test = record_trace(lambda: compiled(x), tmp_path / "compiled.json")
    diff = ops_diff(control, test)
    pointwise = {"aten::sin", "aten::mul", "aten::add", "aten::relu"}
    assert set(diff.deleted) & pointwise, f"the compiled run still calls every eager op:\n{diff}"


# -- hand-made traces: exact sums, categories, classification ------------------------------------


def test_sums_per_name_and_category_ignoring_other_events(tmp_path):
    control = write_trace(tmp_path / "a.json", [("aten::mm", "cpu_op", 10), ("aten::mm", "cpu_op", 5), ("gemm_kernel", "kernel", 7)])
    test = write_trace(
        tmp_path / "b.json",
        [("aten::mm", "cpu_op", 4), ("gemm_kernel", "kernel", 3), ("gemm_kernel", "kernel", 3), ("relu_kernel", "kernel", 1)],
        bare_list=True,  # the other Chrome-trace form: a JSON array of events
    )
    df = compare_traces(control, test)
    expected = pd.DataFrame(
        {
            "category": ["cpu_op", "kernel", "kernel"],
            "control_counts": [2, 1, 0],
            "test_counts": [1, 2, 1],
            "diff_counts": [-1, 1, 1],
            "control_duration": [15.0, 7.0, 0.0],
            "test_duration": [4.0, 6.0, 1.0],
            "diff_duration": [-11.0, -1.0, 1.0],
        },
        index=pd.Index(["aten::mm", "gemm_kernel", "relu_kernel"], name="name"),
    )
    pd.testing.assert_frame_equal(df, expected)


def test_classify_increase_decrease_and_unchanged(tmp_path):
    control = write_trace(tmp_path / "a.json", [("up", "cpu_op", 1), ("down", "cpu_op", 1), ("down", "cpu_op", 1), ("same", "kernel", 1), ("gone", "kernel", 1)])
    test = write_trace(tmp_path / "b.json", [("up", "cpu_op", 1), ("up", "cpu_op", 1), ("down", "cpu_op", 1), ("same", "kernel", 9), ("new", "kernel", 1)])
    diff = ops_diff(control, test)
    assert diff == OpsDiff(added=("new",), deleted=("gone",), increased=("up",), decreased=("down",), unchanged=("same",))
    assert str(diff).splitlines() == ["added (1): new", "deleted (1): gone", "increased (1): up", "decreased (1): down", "unchanged (1): same"]


def test_top_differences_sorts_by_absolute_change(tmp_path):
    control = write_trace(tmp_path / "a.json", [("small", "cpu_op", 10), ("big_drop", "cpu_op", 100), ("rise", "cpu_op", 1)])
    test = write_trace(tmp_path / "b.json", [("small", "cpu_op", 11), ("big_drop", "cpu_op", 1), ("rise", "cpu_op", 50)])
    df = compare_traces(control, test)
    assert list(top_differences(df, 2).index) == ["big_drop", "rise"]
    assert list(top_differences(df, 10, by="diff_counts").index) == list(df.index)  # all 0: order kept
    with pytest.raises(ValueError, match="by must be"):
        top_differences(df, 2, by="duration")


def test_trace_diff_class_shares_the_module_functions():
    assert TraceDiff.compare_traces is compare_traces
    assert TraceDiff.ops_diff is ops_diff
    assert TraceDiff.visualize_counts_diff is visualize_counts_diff
    assert TraceDiff.visualize_duration_diff is visualize_duration_diff


# -- bad input: a clear error naming the file ---------------------------------------------------------


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "no_such_dir"


def _empty_dir(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a trace")
    return tmp_path / "empty"


def _not_a_trace(tmp_path: Path) -> Path:
    (tmp_path / "package.json").write_text(json.dumps({"name": "web", "version": "1.0"}))
    return tmp_path / "package.json"


def _not_json(tmp_path: Path) -> Path:
    (tmp_path / "log.json").write_text("Traceback (most recent call last):\n")
    return tmp_path / "log.json"


def _truncated_json(tmp_path: Path) -> Path:
    whole = write_trace(tmp_path / "whole.json", [("aten::mm", "cpu_op", 1)] * 20).read_text()
    (tmp_path / "cut.json").write_text(whole[: len(whole) // 2])
    return tmp_path / "cut.json"


def _truncated_gzip(tmp_path: Path) -> Path:
    data = gzip.compress(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a" * 9, "dur": 1}] * 200}).encode())
    (tmp_path / "cut.json.gz").write_bytes(data[: len(data) // 2])
    return tmp_path / "cut.json.gz"


def _bad_event(tmp_path: Path) -> Path:
    (tmp_path / "bad.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": "7us"}]}))
    return tmp_path / "bad.json"


@pytest.mark.parametrize(
    "make, message",
    [
        (_missing, "no such file or directory"),
        (_empty_dir, r"no trace files \(\*\.json or \*\.json\.gz\) in this directory \(found: notes\.txt\)"),
        (_not_a_trace, "not a Chrome trace"),
        (_not_json, "not valid JSON"),
        (_truncated_json, "not valid JSON .* is the trace truncated"),
        (_truncated_gzip, "not a complete gzip file .* is the trace truncated"),
        (_bad_event, "event 0 \\(kernel\\) has no name or a non-numeric 'dur'"),
    ],
)
def test_bad_input_names_the_file(tmp_path, make, message):
    bad = make(tmp_path)
    good = write_trace(tmp_path / "good.json", [("aten::mm", "cpu_op", 1)])
    for control, test in ((bad, good), (good, bad)):
        with pytest.raises(TraceDiffError, match=message) as info:
            compare_traces(control, test)
        assert str(info.value).startswith(f"{bad}:")
        assert isinstance(info.value, ValueError)


def test_sets_of_different_sizes_are_refused(tmp_path):
    (tmp_path / "two").mkdir()
    for rank in range(2):
        write_trace(tmp_path / "two" / f"rank{rank}.json", [("aten::mm", "cpu_op", 1)])
    one = write_trace(tmp_path / "one.json", [("aten::mm", "cpu_op", 1)])
    with pytest.raises(TraceDiffError, match="holds 2 trace.*holds 1"):
        compare_traces(tmp_path / "two", one)


# -- charts and reports ----------------------------------------------------------------------------


@pytest.fixture
def small_diff(tmp_path) -> pd.DataFrame:
    control = write_trace(tmp_path / "a.json", [("aten::mm", "cpu_op", 10), ("aten::add", "cpu_op", 5)])
    test = write_trace(tmp_path / "b.json", [("aten::addmm", "cpu_op", 12), ("gemm_kernel", "kernel", 3)])
    return compare_traces(control, test)


def test_charts_as_png_and_html(small_diff, tmp_path):
    out = tmp_path / "out"
    png = visualize_counts_diff(top_differences(small_diff, 3, "diff_counts"), out / "counts.png")
    page = visualize_duration_diff(small_diff, out / "duration.html")
    assert png.read_bytes().startswith(b"\x89PNG")
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert ("plotly" in text) or ("data:image/png;base64," in text)
    assert sorted(p.name for p in out.iterdir()) == ["counts.png", "duration.html"]  # no temporary files


def test_html_without_plotly_embeds_a_matplotlib_image(small_diff, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "plotly", None)  # as if plotly were not installed
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    text = visualize_counts_diff(small_diff, tmp_path / "counts.html").read_text()
    assert "data:image/png;base64," in text


def test_empty_frame_is_not_drawn(small_diff, tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        visualize_counts_diff(small_diff.iloc[:0], tmp_path / "x.png")
    assert not list(tmp_path.glob("x.png*"))


def test_failed_report_leaves_the_old_file_and_no_temporary(small_diff, tmp_path, monkeypatch):
    report = tmp_path / "report.html"
    report.write_text("old report")

    def broken_chart(*args, **kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(trace_diff, "_chart_html", broken_chart)
    with pytest.raises(RuntimeError, match="drawing failed"):
        write_html_report(small_diff, report)
    assert report.read_text() == "old report"
    monkeypatch.undo()
    monkeypatch.setattr(trace_diff, "_html_page", broken_chart)  # now fail inside the atomic write itself
    with pytest.raises(RuntimeError, match="drawing failed"):
        visualize_duration_diff(small_diff, report)
    assert report.read_text() == "old report"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# -- command line ------------------------------------------------------------------------------------


def test_main_prints_the_top_changes_and_writes_the_report(fusion_traces, tmp_path, capsys):
    report, table = tmp_path / "report.html", tmp_path / "diff.csv"
    code = trace_diff.main([str(p) for p in fusion_traces] + ["--top", "2", "--html", str(report), "--csv", str(table)])
    out = capsys.readouterr().out
    assert code == 0
    assert "deleted (2): aten::add, aten::mul" in out and "added (1): aten::addcmul" in out
    assert "diff_duration" in out.splitlines()[0]
    assert len([line for line in out.splitlines() if line.startswith("aten::")]) == 2  # --top 2
    assert "Top 2 by change in duration" in report.read_text()
    assert set(pd.read_csv(table, index_col="name").index) == {"aten::add", "aten::addcmul", "aten::mul"}


def test_main_reports_bad_input_on_stderr(tmp_path, capsys):
    good = write_trace(tmp_path / "good.json", [("aten::mm", "cpu_op", 1)])
    assert trace_diff.main([str(tmp_path / "missing"), str(good)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing'}: no such file or directory\n"
    assert not (tmp_path / "report.html").exists()


def test_python_dash_m_entry_point(fusion_traces, tmp_path):
    report = tmp_path / "report.html"
    command = [sys.executable, "-m", "torchweld.tools.trace_diff", *map(str, fusion_traces), "--top", "10", "--html", str(report)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "added (1): aten::addcmul" in done.stdout
    assert report.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernels_are_compared_beside_cpu_ops(tmp_path):
    x, y, z = (torch.randn(256, 256, device="cuda") for _ in range(3))

    def record(fn, path):
        fn()
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(path))
        return path

    control = record(lambda: torch.add(torch.mul(x, y), z), tmp_path / "a.json")
    test = record(lambda: torch.addcmul(z, x, y), tmp_path / "b.json")
    df = compare_traces(control, test)
    kernels = df[df["category"] == "kernel"]
    assert len(kernels) >= 2, df
    assert (kernels["control_counts"] + kernels["test_counts"] > 0).all()
    assert kernels["diff_counts"].sum() == -1  # two elementwise kernels became one
    assert df.loc["aten::addcmul", "category"] == "cpu_op"
