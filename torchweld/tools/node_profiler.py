"""Time every node of an FX graph over several runs and report where the time goes.

    result = profile(model, torch.randn(1, 3, 32, 32), runs=10)
    print(result)                           # nodes, slowest first, then a summary per operator type
    result.export_chrome_trace("prof.json") # open in chrome://tracing or ui.perfetto.dev

`profile` takes an `nn.Module` or a function, which it traces with
`torch.fx.symbolic_trace`, or a `torch.fx.GraphModule` (one torchweld captured,
say), which it runs as it is. A `torch.fx.Interpreter` runs the graph node by
node; a clock marks the time before and after each node:

- `CpuClock` reads `time.perf_counter_ns`; used when every input, parameter and
  buffer is on the CPU.
- `CudaEventClock` records CUDA events on the current stream and reads them once
  the run is over, so a node's time is the GPU's time for its kernels; used when
  any of them is on a CUDA device. Its event type and synchronize function can be
  replaced, which is how tests run this path on the CPU.

Times are per node and exclude the interpreter's own work between nodes; a
node's share is its mean time over the sum of all nodes' mean times.
Placeholders and the output node are not timed. The graph runs in the caller's
grad mode and the module's own train/eval mode: profile an inference model in
`eval()` under `torch.no_grad()`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
import torch.fx
from torch.utils import _pytree as pytree

from torchweld.errors import TorchweldError, UserLocation

UNTIMED_OPS = ("placeholder", "output")
NUMERIC_COLUMNS = ("nodes", "mean (ms)", "share")  # right-aligned in tables


class ProfileError(TorchweldError, ValueError):
    """`profile` cannot run what it was given; the message says what to pass instead."""


# -- clocks -------------------------------------------------------------------------


class NodeClock(Protocol):
    """Marks points in time; reads them, as seconds since the clock was made, after `synchronize`."""

    device: str

    def mark(self) -> Any: ...

    def synchronize(self) -> None: ...

    def seconds(self, mark: Any) -> float: ...


class CpuClock:
    """Wall-clock time of the calling thread's work, read with `time.perf_counter_ns`."""

    device = "cpu"

    def __init__(self) -> None:
        self._origin = time.perf_counter_ns()

    def mark(self) -> int:
        return time.perf_counter_ns()

    def synchronize(self) -> None:
        pass

    def seconds(self, mark: int) -> float:
        return (mark - self._origin) * 1e-9


class CudaEventClock:
    """GPU time on the current CUDA stream, measured with timing events read after a synchronize.

    Events time the stream, not the kernels alone: when the GPU runs ahead of
    the interpreter, the gaps where it waits for the next launch count too.
    """

    device = "cuda"

    def __init__(self, event_type: Callable[..., Any] | None = None, synchronize: Callable[[], None] | None = None):
        self._event_type = event_type or torch.cuda.Event
        self._synchronize = synchronize or torch.cuda.synchronize
        self._origin = self.mark()

    def mark(self) -> Any:
        event = self._event_type(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        self._synchronize()

    def seconds(self, mark: Any) -> float:
        return self._origin.elapsed_time(mark) * 1e-3  # elapsed_time is in milliseconds


def clock_for(graph_module: torch.nn.Module, inputs: Sequence[Any]) -> NodeClock:
    """A `CudaEventClock` if any input, parameter or buffer is on a CUDA device, else a `CpuClock`."""
    tensors = [x for x in pytree.tree_leaves(list(inputs)) if isinstance(x, torch.Tensor)]
    tensors += list(graph_module.parameters()) + list(graph_module.buffers())
    return CudaEventClock() if any(t.device.type == "cuda" for t in tensors) else CpuClock()


# -- results ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeTiming:
    """One node's times over the timed runs."""

    name: str
    op: str  # call_module, call_function, call_method or get_attr
    target: str  # qualified name: "layer1.0.conv1", "torch.flatten", "operator.add", "view"
    operator: str  # its operator type, for the summary: "Conv2d", "flatten", "add", "view"
    shape: str  # of its output: "[1, 8, 16, 16]", "([2], [2])", "int"
    times_s: tuple[float, ...]

    @property
    def mean_s(self) -> float:
        return sum(self.times_s) / len(self.times_s)


@dataclasses.dataclass(frozen=True)
class OperatorTiming:
    """The nodes of one operator type together: their count and the sum of their mean times."""

    operator: str
    nodes: int
    mean_s: float


@dataclasses.dataclass(frozen=True)
class NodeSpan:
    """When one node ran in one timed run, in seconds since the clock was made."""

    node: str
    run: int
    start_s: float
    duration_s: float


@dataclasses.dataclass(frozen=True, eq=False)
class ProfileResult:
    """Per-node times of a graph; `str()` is a table, slowest node first."""

    graph_module: torch.fx.GraphModule
    runs: int
    device: str  # "cpu" or "cuda": which clock timed it
    nodes: tuple[NodeTiming, ...]  # slowest first; ties in graph order
    spans: tuple[NodeSpan, ...]
    output: Any  # what the graph returned in the last timed run

    @property
    def total_s(self) -> float:
        """The sum of all nodes' mean times: the graph's time per run, without interpreter overhead."""
        return sum(node.mean_s for node in self.nodes)

    def share(self, timing: NodeTiming | OperatorTiming) -> float:
        """A node's or operator type's fraction of `total_s`."""
        return timing.mean_s / self.total_s if self.total_s > 0 else 0.0

    def by_operator(self) -> tuple[OperatorTiming, ...]:
        """One row per operator type (Conv2d, add, ...), slowest first."""
        groups: dict[str, list[NodeTiming]] = {}
        for node in self.nodes:
            groups.setdefault(node.operator, []).append(node)
        rows = [OperatorTiming(op, len(nodes), sum(n.mean_s for n in nodes)) for op, nodes in groups.items()]
        return tuple(sorted(rows, key=lambda row: -row.mean_s))

    def table(self, top: int | None = None) -> str:
        """The nodes, slowest first (the `top` slowest if given), one per line."""
        header = ("node", "op", "target", "shape", "mean (ms)", "share")
        rows = [
            (n.name, n.op, _clip(n.target), _clip(n.shape), f"{n.mean_s * 1e3:.4f}", f"{self.share(n):.1%}")
            for n in self.nodes[:top]
        ]
        title = (
            f"torchweld.profile: {len(self.nodes)} nodes, {self.runs} runs on {self.device}, "
            f"{self.total_s * 1e3:.4f} ms per run"
        )
        return title + "\n" + _format_table(header, rows)

    def operator_table(self) -> str:
        """The summary per operator type, slowest first."""
        header = ("operator", "nodes", "mean (ms)", "share")
        rows = [(o.operator, str(o.nodes), f"{o.mean_s * 1e3:.4f}", f"{self.share(o):.1%}") for o in self.by_operator()]
        return "per operator type\n" + _format_table(header, rows)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.operator_table()

    def export_chrome_trace(self, path: str | os.PathLike) -> Path:
        """Write the timed runs as Chrome-trace JSON (chrome://tracing, ui.perfetto.dev)."""
        path = Path(path)
        text = json.dumps({"traceEvents": _chrome_events(self), "displayTimeUnit": "ms"})
        _write_atomically(path, text.encode())
        return path


def _chrome_events(result: ProfileResult) -> list[dict]:
    nodes = {node.name: node for node in result.nodes}
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": f"torchweld.profile ({result.device})"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "graph"}},
    ]
    for run in range(result.runs):
        spans = [span for span in result.spans if span.run == run]
        start, end = min(s.start_s for s in spans), max(s.start_s + s.duration_s for s in spans)
        events.append(_complete_event(f"run {run}", "run", start, end - start, {"run": run}))
        for span in spans:
            node = nodes[span.node]
            args = {"op": node.op, "target": node.target, "shape": node.shape, "run": run}
            events.append(_complete_event(span.node, node.op, span.start_s, span.duration_s, args))
    return events


def _complete_event(name: str, category: str, start_s: float, duration_s: float, args: dict) -> dict:
    return {"ph": "X", "name": name, "cat": category, "pid": 0, "tid": 0,
            "ts": start_s * 1e6, "dur": duration_s * 1e6, "args": args}  # fmt: skip


def _format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    numeric = [title in NUMERIC_COLUMNS for title in header]

    def line(row: Sequence[str]) -> str:
        cells = [cell.rjust(w) if numeric[i] else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])


def _clip(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename it over `path`: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


# -- running ------------------------------------------------------------------------


class _TimedInterpreter(torch.fx.Interpreter):
    """Runs a graph once, marking the clock before and after every timed node."""

    def __init__(self, graph_module: torch.fx.GraphModule, clock: NodeClock):
        super().__init__(graph_module)
        self.clock = clock
        self.marks: list[tuple[torch.fx.Node, Any, Any]] = []
        self.shapes: dict[str, str] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in UNTIMED_OPS:
            return super().run_node(n)
        start = self.clock.mark()
        value = super().run_node(n)
        self.marks.append((n, start, self.clock.mark()))
        self.shapes[n.name] = describe_value(value)
        return value


def profile(model_or_fn: torch.nn.Module | Callable[..., Any], *inputs: Any, runs: int = 10,
            warmup: int = 1, clock: NodeClock | None = None) -> ProfileResult:  # fmt: skip
    """Run a model `warmup` times untimed, then `runs` times timed, node by node.

    `model_or_fn` is a `torch.fx.GraphModule` (run as it is), or an `nn.Module`
    or function that `torch.fx.symbolic_trace` can trace. `clock` defaults to
    `clock_for(graph_module, inputs)`.
    """
    if runs < 1 or warmup < 0:
        raise ProfileError(f"profile needs runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    graph_module = as_graph_module(model_or_fn)
    clock = clock or clock_for(graph_module, inputs)
    for _ in range(warmup):
        _TimedInterpreter(graph_module, clock).run(*inputs)
    spans: list[NodeSpan] = []
    output, shapes = None, {}
    for run in range(runs):
        interpreter = _TimedInterpreter(graph_module, clock)
        output = interpreter.run(*inputs)
        clock.synchronize()
        spans += _spans(interpreter.marks, clock, run)
        shapes = interpreter.shapes
    nodes = _node_timings(graph_module, spans, shapes)
    return ProfileResult(graph_module, runs, clock.device, nodes, tuple(spans), output)


def as_graph_module(model_or_fn: torch.nn.Module | Callable[..., Any]) -> torch.fx.GraphModule:
    """A GraphModule as it is; anything else through `torch.fx.symbolic_trace`, with a clear error."""
    if isinstance(model_or_fn, torch.fx.GraphModule):
        return model_or_fn
    if not callable(model_or_fn):
        raise ProfileError(f"profile needs an nn.Module, a function or a GraphModule, not {type(model_or_fn).__name__}")
    try:
        return torch.fx.symbolic_trace(model_or_fn)
    except Exception as err:  # tracing runs user code: any error it raises means "cannot trace"
        name = getattr(model_or_fn, "__qualname__", type(model_or_fn).__name__)
        where = _user_location(err)
        line = f"    {where.source_line}\n" if where.source_line else ""
        raise ProfileError(
            f"{where}: torch.fx.symbolic_trace cannot trace {name}: {type(err).__name__}: {err}\n{line}"
            "Capture the model into a torch.fx.GraphModule another way (for example with torchweld) "
            "and pass that GraphModule to profile()."
        ) from err


def _user_location(err: BaseException) -> UserLocation:
    """The innermost frame of the traceback outside torch: the user's line that tracing failed on."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    frames = [f for f in frames if not f.f_code.co_filename.startswith(torch_dir)] or frames
    frame = frames[-1]
    return UserLocation(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def _spans(marks: Iterable[tuple[torch.fx.Node, Any, Any]], clock: NodeClock, run: int) -> list[NodeSpan]:
    spans = []
    for node, start, end in marks:
        start_s = clock.seconds(start)
        spans.append(NodeSpan(node.name, run, start_s, clock.seconds(end) - start_s))
    return spans


def _node_timings(graph_module: torch.fx.GraphModule, spans: list[NodeSpan], shapes: dict[str, str]) -> tuple[NodeTiming, ...]:
    times: dict[str, list[float]] = {}
    for span in spans:
        times.setdefault(span.node, []).append(span.duration_s)
    timings = [
        NodeTiming(n.name, n.op, target_name(n), operator_name(graph_module, n), shapes[n.name], tuple(times[n.name]))
        for n in graph_module.graph.nodes
        if n.op not in UNTIMED_OPS
    ]
    return tuple(sorted(timings, key=lambda timing: -timing.mean_s))  # stable: ties keep graph order


# -- naming nodes ---------------------------------------------------------------------


def target_name(node: torch.fx.Node) -> str:
    """The node's target as a readable qualified name: "layer1.0.conv1", "torch.flatten", "view"."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)  # aten.convolution.default
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or repr(target)
    module = {"_operator": "operator", "torch._C._nn": "torch.nn.functional", "torch._C._VariableFunctions": "torch"}.get(
        module, module
    )
    return f"{module}.{name}" if module else name


def operator_name(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """The node's operator type, which the summary groups by: "Conv2d", "add", "view", "get_attr"."""
    if node.op == "call_module":
        return type(graph_module.get_submodule(node.target)).__name__
    if node.op in ("get_attr", "call_method"):
        return "get_attr" if node.op == "get_attr" else node.target
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target.overloadpacket)  # aten.convolution, whichever overload
    return target_name(node).rsplit(".", 1)[-1]


def describe_value(value: Any) -> str:
    """A node output's shape: "[1, 8, 16, 16]" for a tensor, "([2], [2])" for a tuple, else its type."""
    if isinstance(value, torch.Tensor):
        return str(list(value.shape))
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe_value(item) for item in value) + ")"
    return type(value).__name__
