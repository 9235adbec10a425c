"""`torchweld.explain(fn)(*args)`: run `fn` once through a fresh capture and report
what it captured — graphs, operators, guards, compile times — and where and why
capture stopped."""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import torch

from torchweld.capture.ddp_split import META_KEY as DDP_SPLIT
from torchweld.capture.break_kinds import BreakKind
from torchweld.capture.report import BreakReason, TranslationReport, collecting


@dataclasses.dataclass
class ExplainOutput:
    graphs: list[torch.fx.GraphModule]
    graph_count: int
    graph_break_count: int
    break_reasons: list[BreakReason]
    ops_per_graph: list[list[str]]
    guards: list[str]
    compile_times: list[float]
    reports: list[TranslationReport]

    def __str__(self) -> str:
        lines = [
            f"Graph count: {self.graph_count}",
            f"Graph break count: {self.graph_break_count}",
            f"Op count: {sum(len(ops) for ops in self.ops_per_graph)}",
        ]
        if self.break_reasons:
            lines.append("Break reasons:")
            for i, reason in enumerate(self.break_reasons, 1):
                lines.append(f"  {i}. [{reason.kind.name.lower()}] {reason}".replace("\n", "\n     "))
            lines.append("Breaks by kind:")
            lines.extend(f"  {kind.name.lower()}: {count} ({kind.value})" for kind, count in self.breaks_by_kind.items())
        for i, ops in enumerate(self.ops_per_graph, 1):
            lines.append(f"Ops in graph {i}: {', '.join(ops) if ops else '(none)'}")
        for i, graph in enumerate(self.graphs, 1):
            split = graph.meta.get(DDP_SPLIT)
            if split is not None:
                lines.append(f"Graph {i}: {split}")
        lines.append("Guards:")
        lines.extend(f"  {g}" for g in self.guards)
        lines.append("Compile times: " + ", ".join(f"{t * 1000:.1f} ms" for t in self.compile_times))
        return "\n".join(lines)

    @property
    def breaks_by_kind(self) -> dict[BreakKind, int]:
        """How many breaks of each kind (capture/break_kinds.py), the most frequent first."""
        counts = collections.Counter(reason.kind for reason in self.break_reasons)
        return dict(counts.most_common())

    @property
    def pieces_per_graph(self) -> list[int]:
        """How many pieces each graph was compiled in: 1, or DDP's buckets (capture/ddp_split.py)."""
        return [getattr(g.meta.get(DDP_SPLIT), "pieces", 1) for g in self.graphs]

    def to_html(self, path):
        """Write this report as a self-contained HTML page at `path`; returns the path."""
        from torchweld.tools.explain_html import write_explain_html

        return write_explain_html(self, path)


def _op_names(gm: torch.fx.GraphModule) -> list[str]:
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            names.append(getattr(node.target, "__name__", str(node.target)))
        elif node.op == "call_method":
            names.append(f"Tensor.{node.target}")
        elif node.op == "call_module":
            names.append(type(gm.get_submodule(node.target)).__name__)
    return names


def explain(fn: Callable, backend="eager") -> Callable[..., ExplainOutput]:
    """`explain(fn)(*args, **kwargs)`: compile `fn` afresh, call it once, report."""
    from torchweld.api import compile

    def run(*args, **kwargs) -> ExplainOutput:
        compiled = compile(fn, backend=backend)
        with collecting() as reports:
            compiled(*args, **kwargs)
        graphs = [r.graph for r in reports if r.graph is not None]
        breaks = [r.break_reason for r in reports if r.break_reason is not None]
        return ExplainOutput(
            graphs=graphs, graph_count=len(graphs), graph_break_count=len(breaks), break_reasons=breaks,
            ops_per_graph=[_op_names(g) for g in graphs],
            guards=[g for r in reports for g in r.guards], compile_times=[r.compile_time_s for r in reports],
            reports=reports,
        )

    return run
