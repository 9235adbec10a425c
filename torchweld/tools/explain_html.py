"""Render an `explain()` result as one self-contained HTML page: graphs, graph
breaks with their source lines, guards, compile times and generated kernels.

The page has inline CSS only: no scripts, fonts or other external resources, so
it can be mailed or attached to an issue. Every piece of text from the report
(code, reasons, guards, file names) is HTML-escaped.
"""
from __future__ import annotations

import html
import linecache
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchweld.tools.explain import ExplainOutput

CONTEXT_LINES = 3  # lines of the user's file shown above and below a graph break's line

SECTION_IDS = ("summary", "graphs", "graph-breaks", "guards", "compile-times", "kernels")

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em; color: #1d1d1f; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
pre, code, td.mono { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: .9em; }
pre { background: #f6f8fa; border: 1px solid #e1e4e8; padding: .8em; overflow-x: auto; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { border: 1px solid #d0d7de; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #eef1f4; }
.source .line { display: block; }
.source .lineno { color: #888; user-select: none; display: inline-block; min-width: 3em; }
.source .highlight { background: #fff3b0; font-weight: bold; }
.reason { color: #b3261e; font-weight: bold; }
.empty { color: #777; font-style: italic; }
nav a { margin-right: 1em; }
"""


def render_explain_html(output: "ExplainOutput") -> str:
    """The whole page for `output` (an `ExplainOutput`), as a string."""
    sections = [
        _summary_section(output),
        _graphs_section(output.graphs),
        _breaks_section(output.break_reasons),
        _guards_section(output.guards),
        _compile_times_section(output),
        _kernels_section(getattr(output, "kernels", None) or []),
    ]
    nav = " ".join(f'<a href="#{sid}">{_e(sid.replace("-", " "))}</a>' for sid in SECTION_IDS)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
        "<title>torchweld explain</title>\n"
        f"<style>{_CSS}</style></head>\n<body>\n<h1>torchweld explain</h1>\n<nav>{nav}</nav>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


def write_explain_html(output: "ExplainOutput", path: str | os.PathLike) -> Path:
    """Write the page for `output` to `path` atomically (a temporary file, then a rename)."""
    path = Path(path)
    data = render_explain_html(output).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    # open(..., "xb") rather than tempfile.mkstemp: the file gets the umask's permissions, not 0600.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "xb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


# -- sections ---------------------------------------------------------------------------


def _summary_section(output: "ExplainOutput") -> str:
    op_count = sum(len(ops) for ops in output.ops_per_graph)
    rows = [
        ("Graphs", output.graph_count),
        ("Graph breaks", output.graph_break_count),
        ("Operators", op_count),
        ("Guards", len(output.guards)),
        ("Total compile time", f"{sum(output.compile_times) * 1000:.1f} ms"),
    ]
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return _section("summary", "Summary", f'<table class="summary">{body}</table>')


def _graphs_section(graphs: list[torch.fx.GraphModule]) -> str:
    if not graphs:
        return _section("graphs", "Graphs", _empty("No graphs were captured."))
    parts = []
    for i, gm in enumerate(graphs, 1):
        parts.append(
            f'<section class="graph" id="graph-{i}">\n<h3>Graph {i}</h3>\n'
            f'<h4>Code</h4>\n<pre class="code">{_e(_readable_code(gm))}</pre>\n'
            f"<h4>Nodes</h4>\n{_node_table(gm)}\n</section>"
        )
    return _section("graphs", "Graphs", "\n".join(parts))


def _breaks_section(reasons: list) -> str:
    if not reasons:
        return _section("graph-breaks", "Graph breaks", _empty("No graph breaks."))
    parts = []
    for i, reason in enumerate(reasons, 1):
        location = reason.location
        where = f"{location.filename}:{location.lineno}" if location else "unknown location"
        if location and location.function:
            where += f" in {location.function}"
        times = f" ({reason.count} times)" if reason.count > 1 else ""
        parts.append(
            f'<section class="graph-break" id="graph-break-{i}">\n'
            f'<h3>Break {i}: <span class="reason">{_e(reason.reason)}</span>{_e(times)}</h3>\n'
            f'<p class="location"><code>{_e(where)}</code></p>\n{_source_context(reason)}\n</section>'
        )
    return _section("graph-breaks", "Graph breaks", "\n".join(parts))


def _guards_section(guards: list[str]) -> str:
    if not guards:
        return _section("guards", "Guards", _empty("No guards."))
    items = "".join(f"<li><code>{_e(g)}</code></li>" for g in guards)
    return _section("guards", "Guards", f'<ul class="guards">{items}</ul>')


def _compile_times_section(output: "ExplainOutput") -> str:
    reports = getattr(output, "reports", None) or []
    if reports:
        rows = [
            (r.function, "yes" if r.graph is not None else "no", r.op_count, "yes" if r.break_reason else "no",
             f"{r.compile_time_s * 1000:.1f}")
            for r in reports
        ]
        header = ("Function", "Graph", "Ops", "Break", "Compile time (ms)")
    else:
        rows = [(i, f"{t * 1000:.1f}") for i, t in enumerate(output.compile_times, 1)]
        header = ("Translation", "Compile time (ms)")
    if not rows:
        return _section("compile-times", "Compile times", _empty("Nothing was compiled."))
    total = f"<p>Total: {sum(output.compile_times) * 1000:.1f} ms</p>"
    return _section("compile-times", "Compile times", _table(header, rows, css_class="compile-times") + total)


def _kernels_section(kernels: list[tuple[str, str]]) -> str:
    # Filled once the optimizing backend reports the kernels it generated, as (name, source) pairs.
    if not kernels:
        return _section("kernels", "Generated kernels", _empty("No generated kernels in this report."))
    parts = [
        f'<section class="kernel"><h3><code>{_e(name)}</code></h3>\n<pre class="kernel-source">{_e(source)}</pre></section>'
        for name, source in kernels
    ]
    return _section("kernels", "Generated kernels", "\n".join(parts))


# -- pieces -----------------------------------------------------------------------------


def _readable_code(gm: torch.fx.GraphModule) -> str:
    try:
        return gm.print_readable(print_output=False)
    except Exception:  # print_readable can trip on odd meta; the plain code always exists
        return gm.code


def _node_table(gm: torch.fx.GraphModule) -> str:
    rows = []
    for node in gm.graph.nodes:
        shape, dtype = _describe_value(node.meta.get("example_value"))
        rows.append((node.op, node.name, _target_name(gm, node), repr(node.args), repr(node.kwargs), shape, dtype))
    header = ("opcode", "name", "target", "args", "kwargs", "shape", "dtype")
    return _table(header, rows, css_class="nodes", mono=True)


def _target_name(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "call_module":
        try:
            return f"{target} ({type(gm.get_submodule(target)).__name__})"
        except AttributeError:
            return str(target)
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if name is None:
        return str(target)
    # torch.relu and friends live on a hidden class: torch._VariableFunctionsClass.relu
    name = name.removeprefix("_VariableFunctionsClass.")
    return f"{module}.{name}" if module else name


def _describe_value(value: object) -> tuple[str, str]:
    """(shape, dtype) of an example value: a tensor, a tuple/list of them, a number or None."""
    if value is None:
        return "", ""
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape)), str(value.dtype).removeprefix("torch.")
    if isinstance(value, (tuple, list)):
        described = [_describe_value(v) for v in value]
        return ", ".join(s for s, _ in described), ", ".join(d for _, d in described)
    return "", type(value).__name__


def _source_context(reason) -> str:
    location = reason.location
    if location is None:
        return _empty("No source location.")
    lines = linecache.getlines(location.filename)
    if not 1 <= location.lineno <= len(lines):
        if reason.source_line:
            return f'<pre class="source"><span class="line highlight">{_e(reason.source_line)}</span></pre>'
        return _empty(f"Source of {location.filename} is not available.")
    first = max(1, location.lineno - CONTEXT_LINES)
    last = min(len(lines), location.lineno + CONTEXT_LINES)
    out = []
    for number in range(first, last + 1):
        css = "line highlight" if number == location.lineno else "line"
        text = lines[number - 1].rstrip("\r\n")
        out.append(f'<span class="{css}"><span class="lineno">{number}</span>{_e(text)}</span>')
    return f'<pre class="source">{"".join(out)}</pre>'


def _table(header: tuple, rows: list[tuple], *, css_class: str, mono: bool = False) -> str:
    td = '<td class="mono">' if mono else "<td>"
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"{td}{_e(cell)}</td>" for cell in row) + "</tr>\n" for row in rows)
    return f'<table class="{css_class}"><thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody></table>'


def _section(section_id: str, title: str, body: str) -> str:
    return f'<section id="{section_id}">\n<h2>{_e(title)}</h2>\n{body}\n</section>'


def _empty(text: str) -> str:
    return f'<p class="empty">{_e(text)}</p>'


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)
