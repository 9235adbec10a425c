"""Compare two sets of PyTorch profiler traces, control against test, operator by operator.

A *trace* is the Chrome-trace JSON that `torch.profiler.profile(...).export_chrome_trace`
writes (plain, or gzipped as `*.json.gz`). A *trace set* is one such file, or a
directory of them (one per rank or per run). Like an A/B test, the first set is
the control and the second the test:

    df = compare_traces("eager_traces/", "compiled_traces/")
    top = top_differences(df, n=10)                 # biggest |diff_duration| first
    visualize_duration_diff(top, "duration.html")   # or "duration.png"
    ops_diff("eager_traces/", "compiled_traces/").deleted   # what the compiler removed

Only complete events (`"ph": "X"`) of the categories `cpu_op` (CPU operators,
`aten::mm`, ...) and `kernel` (GPU kernels) are counted. Durations are the
traces' own unit, microseconds, summed over every trace of a set.

From the shell:

    python -m torchweld.tools.trace_diff CONTROL TEST --top 10 --html report.html

Charts go to an HTML file (drawn with plotly if installed, else matplotlib
images inside the page) or to an image file (matplotlib). pandas, plotly and
matplotlib are imported only by the functions that need them. Every file this
module writes is written to a temporary file first and renamed into place.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import gzip
import html
import io
import json
import os
import sys
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, Union

if TYPE_CHECKING:
    import pandas as pd

CATEGORIES: tuple[str, ...] = ("cpu_op", "kernel")  # the event categories compared
TRACE_SUFFIXES: tuple[str, ...] = (".json", ".json.gz")
COLUMNS: tuple[str, ...] = (
    "category",
    "control_counts",
    "test_counts",
    "diff_counts",
    "control_duration",
    "test_duration",
    "diff_duration",
)


class TraceDiffError(ValueError):
    """A trace or trace set that cannot be read; the message names the file."""


# -- reading traces ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One complete event of a compared category: an operator or kernel call."""

    name: str
    category: str
    duration_us: float


@dataclasses.dataclass(frozen=True)
class Trace:
    """The compared events of one trace file."""

    path: Path
    events: tuple[OpEvent, ...]


@dataclasses.dataclass(frozen=True)
class TraceSet:
    """One side of a comparison: the traces of one file or one directory."""

    path: Path
    traces: tuple[Trace, ...]


TraceInput = Union[str, os.PathLike, TraceSet]


def load_trace_set(path: str | os.PathLike) -> TraceSet:
    """Read a trace file, or every `*.json` / `*.json.gz` file of a directory."""
    path = Path(path)
    if not path.exists():
        raise TraceDiffError(f"{path}: no such file or directory")
    files = _trace_files(path) if path.is_dir() else [path]
    return TraceSet(path, tuple(load_trace(file) for file in files))


def load_trace(path: str | os.PathLike) -> Trace:
    """Read one Chrome-trace file and keep its `cpu_op` and `kernel` events."""
    path = Path(path)
    document = _read_json(path)
    events = _trace_events(path, document)
    return Trace(path, tuple(_op_events(path, events)))


def _trace_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
    if not files:
        found = ", ".join(sorted(p.name for p in directory.iterdir())[:5]) or "nothing"
        raise TraceDiffError(
            f"{directory}: no trace files (*.json or *.json.gz) in this directory (found: {found}); "
            "write traces with torch.profiler's prof.export_chrome_trace(path)"
        )
    return files


def _read_json(path: Path) -> object:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as stream:
            return json.load(stream)
    except json.JSONDecodeError as err:
        raise TraceDiffError(f"{path}: not valid JSON ({err}); is the trace truncated?") from err
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise TraceDiffError(f"{path}: not a complete gzip file ({err}); is the trace truncated?") from err
    except UnicodeDecodeError as err:
        raise TraceDiffError(f"{path}: not a text JSON file ({err})") from err
    except OSError as err:
        raise TraceDiffError(f"{path}: cannot be read ({err})") from err


def _trace_events(path: Path, document: object) -> list:
    # Chrome traces are either {"traceEvents": [...], ...} or a bare list of events.
    events = document.get("traceEvents") if isinstance(document, dict) else document
    if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
        raise TraceDiffError(
            f"{path}: not a Chrome trace (expected an object with a 'traceEvents' list of events); "
            "write traces with torch.profiler's prof.export_chrome_trace(path)"
        )
    return events


def _op_events(path: Path, events: list[dict]) -> Iterable[OpEvent]:
    for index, event in enumerate(events):
        if event.get("ph") != "X" or event.get("cat") not in CATEGORIES:
            continue
        name, duration = event.get("name"), event.get("dur", 0)
        if not isinstance(name, str) or not isinstance(duration, (int, float)):
            raise TraceDiffError(f"{path}: event {index} ({event.get('cat')}) has no name or a non-numeric 'dur'")
        yield OpEvent(name, event["cat"], float(duration))


def _as_trace_set(source: TraceInput) -> TraceSet:
    return source if isinstance(source, TraceSet) else load_trace_set(source)


# -- comparing --------------------------------------------------------------------


def op_totals(traces: TraceInput) -> "pd.DataFrame":
    """Count and total duration (µs) of each operator and kernel over a trace set.

    Indexed by name, with columns `category`, `counts`, `duration`.
    """
    pd = _pandas()
    trace_set = _as_trace_set(traces)
    rows = [(e.name, e.category, e.duration_us) for trace in trace_set.traces for e in trace.events]
    frame = pd.DataFrame(rows, columns=["name", "category", "duration"])
    grouped = frame.groupby(["name", "category"], sort=True)["duration"].agg(["count", "sum"])
    grouped = grouped.rename(columns={"count": "counts", "sum": "duration"}).reset_index("category")
    return grouped.astype({"counts": "int64", "duration": "float64"})


def compare_traces(control: TraceInput, test: TraceInput) -> "pd.DataFrame":
    """Per operator and kernel: counts and total durations (µs) in each set, and test - control.

    Indexed by name; columns `category` ("cpu_op" or "kernel"), `control_counts`,
    `test_counts`, `diff_counts`, `control_duration`, `test_duration`,
    `diff_duration`. An operator missing from one set counts 0 there. Both sets
    must hold the same number of traces, since totals are compared. A name seen
    both as a CPU operator and as a kernel (rare) has one row for each.
    """
    pd = _pandas()
    control_set, test_set = _as_trace_set(control), _as_trace_set(test)
    _check_same_size(control_set, test_set)
    merged = pd.merge(
        op_totals(control_set).reset_index(),
        op_totals(test_set).reset_index(),
        on=["name", "category"],
        how="outer",
        suffixes=("_control", "_test"),
    )
    frame = pd.DataFrame(
        {
            "name": merged["name"],
            "category": merged["category"],
            "control_counts": merged["counts_control"].fillna(0).astype("int64"),
            "test_counts": merged["counts_test"].fillna(0).astype("int64"),
            "control_duration": merged["duration_control"].fillna(0.0),
            "test_duration": merged["duration_test"].fillna(0.0),
        }
    )
    frame["diff_counts"] = frame["test_counts"] - frame["control_counts"]
    frame["diff_duration"] = frame["test_duration"] - frame["control_duration"]
    frame = frame.set_index("name")[list(COLUMNS)].sort_index()
    frame.attrs.update(control=str(control_set.path), test=str(test_set.path))
    return frame


def _check_same_size(control: TraceSet, test: TraceSet) -> None:
    if len(control.traces) != len(test.traces):
        raise TraceDiffError(
            f"{control.path} holds {len(control.traces)} trace(s) but {test.path} holds "
            f"{len(test.traces)}: totals of sets of different sizes do not compare; "
            "compare sets with the same number of ranks/runs, or single files"
        )


@dataclasses.dataclass(frozen=True)
class OpsDiff(Mapping):
    """Operator and kernel names by how their call count changed from control to test; also a
    mapping of those five names to the tuples, as HTA's ops_diff dict is: `diff["added"]`."""

    added: tuple[str, ...]  # only in the test set
    deleted: tuple[str, ...]  # only in the control set
    increased: tuple[str, ...]  # in both, called more often in the test set
    decreased: tuple[str, ...]  # in both, called less often in the test set
    unchanged: tuple[str, ...]  # in both, called as often

    def __getitem__(self, kind: str) -> tuple[str, ...]:
        if kind not in self._kinds():
            raise KeyError(kind)
        return getattr(self, kind)

    def __iter__(self):
        return iter(self._kinds())

    def __len__(self) -> int:
        return len(self._kinds())

    def _kinds(self) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(self))

    def __str__(self) -> str:
        lines = []
        for field in dataclasses.fields(self):
            names = getattr(self, field.name)
            lines.append(f"{field.name} ({len(names)}): {', '.join(names) if names else '-'}")
        return "\n".join(lines)


def ops_diff(control: TraceInput, test: TraceInput) -> OpsDiff:
    """The operators and kernels added, deleted, increased, decreased and unchanged in count."""
    return classify_ops(compare_traces(control, test))


def classify_ops(df: "pd.DataFrame") -> OpsDiff:
    """Sort the rows of a `compare_traces` DataFrame into an `OpsDiff`."""
    control, test = df["control_counts"], df["test_counts"]
    masks = {
        "added": (control == 0) & (test > 0),
        "deleted": (control > 0) & (test == 0),
        "increased": (control > 0) & (test > control),
        "decreased": (test > 0) & (test < control),
        "unchanged": (control > 0) & (test == control),
    }
    return OpsDiff(**{kind: tuple(sorted(df.index[mask])) for kind, mask in masks.items()})


def top_differences(df: "pd.DataFrame", n: int = 10, by: str = "diff_duration") -> "pd.DataFrame":
    """The n rows of a `compare_traces` DataFrame with the largest |df[by]|, largest first."""
    if by not in ("diff_duration", "diff_counts"):
        raise ValueError(f"top_differences: by must be 'diff_duration' or 'diff_counts', not {by!r}")
    return df.sort_values(by, key=lambda column: column.abs(), ascending=False, kind="stable").head(n)


# -- drawing ------------------------------------------------------------------------


def visualize_counts_diff(df: "pd.DataFrame", path: str | os.PathLike) -> Path:
    """Draw `df["diff_counts"]` as a bar chart into `path` (.html, or an image such as .png)."""
    return _write_chart(df, "diff_counts", "Change in call count (test - control)", Path(path))


def visualize_duration_diff(df: "pd.DataFrame", path: str | os.PathLike) -> Path:
    """Draw `df["diff_duration"]` (µs) as a bar chart into `path` (.html, or an image such as .png)."""
    return _write_chart(df, "diff_duration", "Change in total duration, µs (test - control)", Path(path))


def _write_chart(df: "pd.DataFrame", column: str, title: str, path: Path) -> Path:
    if df.empty:
        raise ValueError(f"nothing to draw into {path}: the DataFrame has no rows")
    if path.suffix.lower() in (".html", ".htm"):
        body = _chart_html(df, column, title)
        _write_atomically(path, lambda stream: stream.write(_html_page(title, body).encode()))
    else:
        figure = _matplotlib_figure(df, column, title)
        fmt = path.suffix.lstrip(".").lower() or "png"
        _write_atomically(path, lambda stream: figure.savefig(stream, format=fmt, bbox_inches="tight"))
    return path


def _chart_html(df: "pd.DataFrame", column: str, title: str) -> str:
    """A chart as an HTML fragment: interactive with plotly if installed, else a matplotlib image."""
    try:
        import plotly.graph_objects as go
    except ModuleNotFoundError:
        return _matplotlib_img_tag(df, column, title)
    labels = [_short(name) for name in df.index]
    figure = go.Figure(go.Bar(x=df[column].tolist(), y=labels, orientation="h", hovertext=list(df.index)))
    figure.update_layout(title=title, yaxis={"autorange": "reversed"}, height=120 + 28 * len(df))
    return figure.to_html(full_html=False, include_plotlyjs=True)


def _matplotlib_img_tag(df: "pd.DataFrame", column: str, title: str) -> str:
    figure = _matplotlib_figure(df, column, title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}">'


def _matplotlib_figure(df: "pd.DataFrame", column: str, title: str):
    try:
        from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "drawing a trace diff needs matplotlib (pip install matplotlib), "
            "or plotly (pip install plotly) for .html output"
        ) from err
    values = df[column].tolist()
    figure = Figure(figsize=(10, 1 + 0.35 * len(values)))
    axes = figure.subplots()
    colors = ["tab:red" if value > 0 else "tab:green" for value in values]
    axes.barh([_short(name) for name in df.index], values, color=colors)
    axes.invert_yaxis()
    axes.axvline(0, color="black", linewidth=0.8)
    axes.set_title(title)
    return figure


def _short(name: str, limit: int = 60) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


# -- reports --------------------------------------------------------------------------


def write_html_report(df: "pd.DataFrame", path: str | os.PathLike, *, top: int = 10) -> Path:
    """One HTML page: the `top` largest changes by duration and by count, as charts and tables."""
    by_duration = top_differences(df, top, "diff_duration")
    by_counts = top_differences(df, top, "diff_counts")
    title = f"TraceDiff: {df.attrs.get('control', 'control')} vs {df.attrs.get('test', 'test')}"
    sections = [
        f"<h2>Top {top} by change in duration</h2>",
        _chart_html(by_duration, "diff_duration", "Change in total duration, µs (test - control)"),
        by_duration.to_html(float_format="%.1f"),
        f"<h2>Top {top} by change in count</h2>",
        _chart_html(by_counts, "diff_counts", "Change in call count (test - control)"),
        by_counts.to_html(float_format="%.1f"),
        f"<h2>Operators by change</h2><pre>{html.escape(str(classify_ops(df)))}</pre>",
    ]
    path = Path(path)
    _write_atomically(path, lambda stream: stream.write(_html_page(title, "\n".join(sections)).encode()))
    return path


def _html_page(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title></head>\n<body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n"
    )


def _write_atomically(path: Path, write: Callable[[io.BufferedWriter], object]) -> None:
    """Write through a temporary file in the same directory, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # open(..., "xb") rather than tempfile.mkstemp: the file gets the umask's permissions, not 0600.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "xb") as stream:
            write(stream)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


# -- the TraceDiff class ------------------------------------------------------------------


class TraceDiff:
    """The module's functions, gathered as static methods: `TraceDiff.compare_traces(a, b)`."""

    load_trace_set = staticmethod(load_trace_set)
    op_totals = staticmethod(op_totals)
    compare_traces = staticmethod(compare_traces)
    ops_diff = staticmethod(ops_diff)
    classify_ops = staticmethod(classify_ops)
    top_differences = staticmethod(top_differences)
    visualize_counts_diff = staticmethod(visualize_counts_diff)
    visualize_duration_diff = staticmethod(visualize_duration_diff)
    write_html_report = staticmethod(write_html_report)


# -- command line ------------------------------------------------------------------------


def _pandas():
    try:
        import pandas
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("TraceDiff needs pandas: pip install pandas") from err
    return pandas


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchweld.tools.trace_diff",
        description="Compare PyTorch profiler traces: CONTROL (A) against TEST (B), per operator and kernel.",
    )
    parser.add_argument("control", help="a Chrome-trace file (.json/.json.gz) or a directory of them")
    parser.add_argument("test", help="a Chrome-trace file (.json/.json.gz) or a directory of them")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest changes to show (default 10)")
    parser.add_argument("--sort-by", choices=("diff_duration", "diff_counts"), default="diff_duration")
    parser.add_argument("--html", metavar="PATH", help="also write an HTML report with charts to PATH")
    parser.add_argument("--csv", metavar="PATH", help="also write the whole comparison as CSV to PATH")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Print the largest changes and the added/deleted operators; write the asked-for files."""
    args = _parser().parse_args(argv)
    if args.top < 1:
        _parser().error(f"--top must be at least 1, not {args.top}")
    try:
        df = compare_traces(args.control, args.test)
    except TraceDiffError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    pd = _pandas()
    with pd.option_context("display.max_colwidth", 60, "display.width", 200):
        print(top_differences(df, args.top, args.sort_by).to_string(float_format=lambda v: f"{v:.1f}"))
    print()
    print(classify_ops(df))
    if args.csv:
        _write_atomically(Path(args.csv), lambda stream: stream.write(df.to_csv().encode()))
        print(f"wrote {args.csv}")
    if args.html:
        write_html_report(df, args.html, top=args.top)
        print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
