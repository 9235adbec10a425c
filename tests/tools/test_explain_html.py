"""Tests of torchweld.tools.explain_html on reports built by torchweld.explain: the page's
sections, highlighted break lines, escaping, self-containment, and (with Chromium) how a
browser parses it."""
from __future__ import annotations

import linecache
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn

import torchweld
from torchweld.capture.report import BreakReason
from torchweld.errors import UserLocation
from torchweld.tools.explain import ExplainOutput
from torchweld.tools.explain_html import SECTION_IDS, render_explain_html, write_explain_html

# -- a small DOM built with html.parser ---------------------------------------------------

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Element:
    def __init__(self, tag: str, attrs: dict[str, str | None]):
        self.tag, self.attrs, self.children = tag, attrs, []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self):
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.iter()

    def find_all(self, tag: str | None = None, cls: str | None = None, id: str | None = None) -> list["Element"]:
        return [
            e for e in self.iter()
            if (tag is None or e.tag == tag) and (cls is None or cls in e.classes) and (id is None or e.attrs.get("id") == id)
        ]

    def find(self, **kw) -> "Element":
        found = self.find_all(**kw)
        assert found, f"no element matching {kw}"
        return found[0]


class TreeBuilder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        element = Element(tag, dict(attrs))
        self.stack[-1].children.append(element)
        if tag not in _VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Element(tag, dict(attrs)))

    def handle_endtag(self, tag):
        if tag in _VOID:
            return
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse(page: str) -> Element:
    builder = TreeBuilder()
    builder.feed(page)
    builder.close()
    assert builder.stack == [builder.root], "unclosed elements: " + ", ".join(e.tag for e in builder.stack[1:])
    return builder.root


# -- programs to explain ------------------------------------------------------------------


def plain(x):
    return torch.sin(x) + 1


def data_dependent(x):
    y = x * 2
    if x.sum() > 0:
        return y.sin()
    return y.cos()


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _assert_self_contained(page: str, tree: Element) -> None:
    assert "<script" not in page.lower()
    for element in tree.iter():
        for name in ("src", "href", "action", "srcset"):
            value = element.attrs.get(name)
            if value is not None:
                assert value.startswith("#"), f"<{element.tag} {name}={value!r}> points outside the page"
    assert "http://" not in page and "https://" not in page
    assert "@import" not in page and "url(" not in page


# -- tests --------------------------------------------------------------------------------


def test_plain_function_page(tmp_path):
    output = torchweld.explain(plain)(torch.randn(4))
    assert output.graph_count == 1
    path = output.to_html(tmp_path / "explain.html")
    assert Path(path) == tmp_path / "explain.html"
    page = path.read_text(encoding="utf-8")
    tree = parse(page)

    for section_id in SECTION_IDS:
        tree.find(tag="section", id=section_id)
    graphs = tree.find(id="graphs").find_all(tag="section", cls="graph")
    assert len(graphs) == 1
    code = graphs[0].find(tag="pre", cls="code").text()
    assert "torch.sin" in code and "def forward" in code

    rows = graphs[0].find(tag="table", cls="nodes").find_all(tag="tr")
    header = [th.text() for th in rows[0].find_all(tag="th")]
    assert header == ["opcode", "name", "target", "args", "kwargs", "shape", "dtype"]
    cells = [[td.text() for td in row.find_all(tag="td")] for row in rows[1:]]
    assert [c[0] for c in cells] == [n.op for n in output.graphs[0].graph.nodes]
    sin_row = next(c for c in cells if c[0] == "call_function" and "sin" in c[2])
    assert sin_row[5] == "(4,)" and sin_row[6] == "float32"

    assert tree.find(id="graph-breaks").find_all(cls="empty")
    assert tree.find(id="kernels").find_all(cls="empty")
    compile_rows = tree.find(tag="table", cls="compile-times").find_all(tag="tr")
    assert len(compile_rows) == 1 + len(output.compile_times)
    _assert_self_contained(page, tree)


def test_guards_are_listed_and_escaped(tmp_path):
    output = torchweld.explain(plain)(torch.randn(4))
    assert any("<" in g for g in output.guards), output.guards  # e.g. G['torch'] is <torch>
    page = render_explain_html(output)
    tree = parse(page)
    listed = [li.text() for li in tree.find(id="guards").find_all(tag="li")]
    assert listed == output.guards
    for guard in output.guards:
        if "<" in guard:
            assert guard not in page
            assert guard.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("'", "&#x27;") in page


def test_data_dependent_break_line_is_highlighted(tmp_path):
    x = torch.randn(8)
    output = torchweld.explain(data_dependent)(x)
    assert output.graph_break_count >= 1
    page = output.to_html(tmp_path / "dd.html").read_text(encoding="utf-8")
    tree = parse(page)

    breaks = tree.find(id="graph-breaks").find_all(tag="section", cls="graph-break")
    assert len(breaks) == len(output.break_reasons)
    highlighted = [e.text() for b in breaks for e in b.find_all(cls="highlight")]
    assert any("if x.sum() > 0:" in text for text in highlighted), highlighted
    for reason, element in zip(output.break_reasons, breaks):
        assert reason.reason in element.text()
        if reason.location and reason.location.filename == __file__:
            assert f"{Path(__file__).name}:{reason.location.lineno}" in element.text()
            # context around the break line, the line itself marked
            source = element.find(tag="pre", cls="source")
            numbers = [int(n.text()) for n in source.find_all(cls="lineno")]
            assert reason.location.lineno in numbers and len(numbers) > 1
            marked = source.find(cls="highlight")
            assert marked.find(cls="lineno").text() == str(reason.location.lineno)
            assert linecache.getline(__file__, reason.location.lineno).strip() in marked.text()
    _assert_self_contained(page, tree)


def test_module_page(tmp_path):
    net = SmallNet()
    output = torchweld.explain(net)(torch.randn(2, 4))
    assert output.graph_count >= 1
    tree = parse(output.to_html(tmp_path / "net.html").read_text(encoding="utf-8"))
    tables = tree.find(id="graphs").find_all(tag="table", cls="nodes")
    assert len(tables) == output.graph_count
    cells = [[td.text() for td in row.find_all(tag="td")] for t in tables for row in t.find_all(tag="tr")[1:]]
    # the output of the network has the example value's shape (2, 3)
    assert any(c[5] == "(2, 3)" and c[6] == "float32" for c in cells), cells
    assert any(c[0] == "call_function" and c[2] == "torch.relu" for c in cells), cells
    assert any(c[0] == "call_module" and c[2].endswith("(Linear)") for c in cells), cells


def _hostile_output(kernels=None) -> ExplainOutput:
    location = UserLocation(__file__, data_dependent.__code__.co_firstlineno + 2, "data_dependent")
    output = ExplainOutput(
        graphs=[], graph_count=0, graph_break_count=1,
        break_reasons=[BreakReason("<script>alert('reason')</script> & more", location, count=3)],
        ops_per_graph=[], guards=["L['x'] < 3 and \"<b>\""], compile_times=[0.002], reports=[],
    )
    if kernels is not None:
        output.kernels = kernels
    return output


def test_everything_is_escaped():
    page = render_explain_html(_hostile_output(kernels=[("k<0>", "void k() { if (a < b && c > d) {} }</pre>")]))
    tree = parse(page)
    assert not tree.find_all(tag="script") and not tree.find_all(tag="b")
    assert "<script>alert" not in page and "&lt;script&gt;alert" in page
    break_text = tree.find(id="graph-break-1").text()
    assert "<script>alert('reason')</script> & more" in break_text and "(3 times)" in break_text
    assert tree.find(id="guards").find(tag="li").text() == "L['x'] < 3 and \"<b>\""
    kernel = tree.find(id="kernels").find(cls="kernel")
    assert "k<0>" in kernel.text()
    assert kernel.find(tag="pre", cls="kernel-source").text() == "void k() { if (a < b && c > d) {} }</pre>"


def test_kernels_section_empty_without_attribute():
    tree = parse(render_explain_html(_hostile_output()))
    kernels = tree.find(tag="section", id="kernels")
    assert kernels.find_all(cls="empty") and not kernels.find_all(cls="kernel")


def test_missing_source_file_still_renders():
    output = _hostile_output()
    output.break_reasons.append(BreakReason("no file", UserLocation("<string>", 4, "f")))
    output.break_reasons.append(BreakReason("no location", None))
    tree = parse(render_explain_html(output))
    assert len(tree.find(id="graph-breaks").find_all(tag="section", cls="graph-break")) == 3


def test_write_is_atomic_and_overwrites(tmp_path):
    path = tmp_path / "sub" / "report.html"
    path.parent.mkdir()
    path.write_text("old")
    assert write_explain_html(_hostile_output(), path) == path
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.html"]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_chromium_parses_page(tmp_path):
    output = torchweld.explain(data_dependent)(torch.randn(8))
    path = output.to_html(tmp_path / "page.html")
    result = subprocess.run(
        [shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.resolve().as_uri()],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    dom = parse_lenient(result.stdout)
    for section_id in SECTION_IDS:
        dom.find(tag="section", id=section_id)
    highlighted = [e.text() for e in dom.find(id="graph-breaks").find_all(cls="highlight")]
    assert any("if x.sum() > 0:" in text for text in highlighted), highlighted


def parse_lenient(page: str) -> Element:
    """Chromium's serialized DOM: well formed, but a `<head>` may hold whitespace text nodes anywhere."""
    builder = TreeBuilder()
    builder.feed(page)
    builder.close()
    return builder.root
