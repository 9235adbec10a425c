"""Render benchmark records (bench/records/*.jsonl) as tables: bench/RESULTS.md, the README's
comparison table, or the difference between two commits.

    python bench/render.py                      # write bench/RESULTS.md: the latest record of each row
    python bench/render.py --readme             # rewrite README.md's table between its markers
    python bench/render.py --diff A B           # each row's latest record at commit A against B's
    python bench/render.py --stdout             # print RESULTS.md instead of writing it

A row of the harness's suite ("models") is one model at one size, phase, mode, dtype and
device (a GPU model, or "CPU"); its latest record (by date) is shown whole, with its commit
and host, so that the compilers of a row always come from one command. Speed is eager's
time over the compiler's (higher is better); cold is torchweld's first call(s), compile
included, over torch.compile's (lower is better).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402

README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "RESULTS.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NAMES = {"eager": "eager", "torch": "torch.compile", "torchweld": "torchweld"}

# The README's table: (what it calls the row, what a record must match). Rows without a record
# are left out. A record from a --quick run (smaller sizes) never stands for a row.
README_ROWS = [
    ("resnet50 b32 inference", dict(model="resnet50", phase="inference", mode="default")),
    ("densenet121 b16 inference", dict(model="densenet121", phase="inference", mode="default")),
    ("BERT b8 s128 inference", dict(model="bert", phase="inference", mode="default")),
    ("GPT-2 b8 s256 inference", dict(model="gpt2", phase="inference", mode="default")),
    ("Llama-style decoder b8 s256 inference", dict(model="llama", phase="inference", mode="default")),
    ("elementwise chain, 16M floats", dict(model="chain", phase="inference", mode="default")),
    ("reduce-overhead: densenet121 inference", dict(model="densenet121", phase="inference", mode="reduce-overhead")),
    ("reduce-overhead: resnet50 inference", dict(model="resnet50", phase="inference", mode="reduce-overhead")),
    ("reduce-overhead: BERT inference", dict(model="bert", phase="inference", mode="reduce-overhead")),
    ("reduce-overhead: GPT-2 inference", dict(model="gpt2", phase="inference", mode="reduce-overhead")),
    ("training, model compiled (Adam native): resnet50", dict(model="resnet50", phase="training", step="model",
                                                              mode="default")),
    ("training, model compiled: BERT", dict(model="bert", phase="training", step="model", mode="default")),
    ("training, model compiled: GPT-2", dict(model="gpt2", phase="training", step="model", mode="default")),
    ("the tutorial's whole densenet121 step", dict(model="densenet121", phase="training", step="whole step",
                                                   mode="default")),
    ("the same step under reduce-overhead", dict(model="densenet121", phase="training", step="whole step",
                                                 mode="reduce-overhead")),
]
README_DEVICE = dict(device="cuda", dtype="float32")


# =============================================================================
# Rows
# =============================================================================


def short_gpu(name: str | None) -> str:
    """"NVIDIA H100 80GB HBM3" -> "H100"."""
    if not name:
        return "CUDA"
    words = name.replace("NVIDIA", "").split()
    return words[0] if words else name


def where(record: dict) -> str:
    row = record["row"]
    return short_gpu(record.get("gpu")) if row["device"] == "cuda" else "CPU"


def row_key(record: dict) -> tuple:
    row = record["row"]
    return (where(record), row["phase"], row.get("step") or "", row["mode"], row["dtype"], row["label"])


def latest_per_row(recs: list[dict]) -> dict[tuple, dict]:
    """The latest record of each row (by date; of equal dates, the one written last)."""
    latest: dict[tuple, dict] = {}
    for r in recs:
        key = row_key(r)
        if key not in latest or r["date"] >= latest[key]["date"]:
            latest[key] = r
    return latest


def harness_records(directory: Path | None = None) -> list[dict]:
    """The harness's records (bench/harness.py's suite, "models"): other suites' rows have other fields."""
    return [r for r in records.read(directory=directory) if r.get("bench") == "models" and "row" in r and "figures" in r]


def short_commit(record: dict) -> str:
    commit = (record.get("commit") or "?")[:7]
    dirty = "+" if record.get("dirty") else ""
    if record.get("source") == "diary":
        return f"{commit} (diary, session {record.get('session', '?')})"
    return commit + dirty


# =============================================================================
# Formatting
# =============================================================================


def fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def speed_cell(f: dict | None, eager: bool = False) -> str:
    if not f:
        return "-"
    if "error" in f:
        return "failed"
    if eager:
        return fmt(f.get("ms"), ".3f")
    return f"{fmt(f.get('ms'), '.3f')} ({fmt(f.get('speedup'), '.2f', 'x')})"


def cold_of(f: dict | None):
    if not f:
        return None
    return f.get("cold_s", f.get("first_s"))


def compilers_of(recs) -> list[str]:
    seen = {c for r in recs for c in r["figures"]["compilers"]}
    return [c for c in ("eager", "torch", "torchweld") if c in seen] + sorted(seen - set(NAMES))


def table(recs: list[dict]) -> list[str]:
    compilers = compilers_of(recs)
    memory = any(f.get("peak_mib") is not None for r in recs for f in r["figures"]["compilers"].values())
    head = ["row"] + [f"{NAMES.get(c, c)} ms" + ("" if c == "eager" else " (x eager)") for c in compilers]
    head += ["cold s " + " / ".join(NAMES.get(c, c) for c in compilers), "weld / tc cold"]
    warm = [c for c in compilers if any("warm_s" in r["figures"]["compilers"].get(c, {}) for r in recs)]
    if warm:  # --warm: the first calls again, in a second process with the caches the first filled
        head.append("warm s " + " / ".join(NAMES.get(c, c) for c in warm))
    if memory:
        head.append("peak MiB " + " / ".join(NAMES.get(c, c) for c in compilers))
    head += ["commit", "host", "date"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in recs:
        figures = r["figures"]["compilers"]
        cells = [r["row"]["label"]] + [speed_cell(figures.get(c), c == "eager") for c in compilers]
        cells.append(" / ".join(fmt(cold_of(figures.get(c)), ".2f") for c in compilers))
        cells.append(fmt(figures.get("torchweld", {}).get("cold_vs_torch"), ".3f"))
        if warm:
            cells.append(" / ".join(fmt((figures.get(c) or {}).get("warm_s"), ".2f") for c in warm))
        if memory:
            cells.append(" / ".join(fmt((figures.get(c) or {}).get("peak_mib"), ".0f") for c in compilers))
        cells += [short_commit(r), r.get("host") or "?", (r.get("date") or "")[:10]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def section_title(key: tuple) -> str:
    place, phase, step, mode, dtype, _ = key
    what = phase + (f", {step} compiled" if step else "")
    if dtype.startswith("amp_"):
        dtype = f"float32 under {dtype[len('amp_'):]} autocast"
    return f"{place}, {what}, {mode} mode, {dtype}"


# =============================================================================
# RESULTS.md, README, diff
# =============================================================================


def render_results(directory: Path | None = None) -> str:
    recs = harness_records(directory)
    latest = latest_per_row(recs)
    out = ["# Benchmark results", "",
           "<!-- Rendered by `python bench/render.py` from bench/records/*.jsonl: edit the records, not this page. -->",
           "",
           "The latest record of each row, measured with `bench/harness.py` (its docstring says what each "
           "figure is), with the commit and host it ran on: compare a figure with its neighbours in the row, "
           "which come from one command. `ms (x eager)`: steady state, and eager's time over it (higher is "
           "better); cold: the first call(s), compile included, with empty caches; warm: the same in a second "
           "process, with the caches the first filled; `weld / tc cold`: "
           "torchweld's cold over torch.compile's (lower is better). A commit marked `diary` is a figure "
           "copied from the old diary (`bench/investigations/RESULTS-diary.md`, the session named), measured "
           "by the scripts of then; decisions drawn from the measurements are in `bench/DECISIONS.md`; "
           "`python bench/render.py --diff A B` compares two commits.", ""]
    groups: dict[tuple, list[dict]] = {}
    for key, r in sorted(latest.items(), key=lambda kv: _order(kv[0], kv[1]["row"].get("model", ""))):
        groups.setdefault(key[:5], []).append(r)
    if not groups:
        out += ["No records yet: run `python bench/harness.py` (see its docstring).", ""]
    for group, recs_ in groups.items():
        out += [f"## {section_title(group + ('',))}", ""] + table(recs_) + [""]
        commands = sorted({(r.get("command", ""), r.get("source") == "diary") for r in recs_})
        out += ["Commands: " + "; ".join(f"`{c}`" + (" (diary: the script is under bench/investigations/ now)" if diary
                                                     else "") for c, diary in commands if c), ""]
    out += decode_section(directory)
    out += distributed_section(directory)
    out += dynamic_sizes_section(directory)
    out += overhead_section(directory)
    out += other_suites(directory)
    return "\n".join(out).rstrip() + "\n"


def decode_section(directory: Path | None) -> list[str]:
    """LLM decoding (bench/decode.py): the latest record of each GPU (or the CPU) and model,
    its rows a compiler and batch size each."""
    latest: dict[tuple, dict] = {}
    for r in records.read("decode", directory=directory):
        key = (short_gpu(r.get("gpu")) or "CPU", r.get("options", {}).get("model", "gpt-fast"))
        if key not in latest or r.get("date", "") >= latest[key].get("date", ""):
            latest[key] = r
    out = []
    for (where_run, model), record in latest.items():
        options = record.get("options", {})
        name = "transformers' LlamaForCausalLM (StaticCache)" if model == "transformers" else "Llama-style decoder"
        out += [f"## LLM decoding: {options.get('preset', '?')} {name}, {options.get('dtype', '?')}, "
                f"mode {options.get('mode', '?')} ({where_run}, {short_commit(record)})", "",
                "| compiler | batch | ms / token | tokens / s | x eager | of bandwidth floor | first calls s | max diff |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in record["figures"]["rows"]:
            if "error" in row:
                out.append(f"| {NAMES.get(row['compiler'], row['compiler'])} | {row['batch']} | failed | | | | | |")
                continue
            out.append(f"| {NAMES.get(row['compiler'], row['compiler'])} | {row['batch']} | {row['ms']:.3f} | "
                       f"{row['tokens_per_s']:.0f} | {fmt(row.get('speedup'), '.2f', 'x')} | {row['of_floor']:.0%} | "
                       f"{row['first_s']:.1f} | {fmt(row.get('max_diff'), '.1e')} |")
        out += ["", f"Command: `{record.get('command', '')}`", ""]
    return out


def _latest_rows(suite: str, directory: Path | None) -> list[dict]:
    """The latest record of each row of `suite` (records with a "row"), in the order first seen."""
    latest: dict[str, dict] = {}
    for r in records.read(suite, directory=directory):
        if "row" in r:
            key = json.dumps(r["row"], sort_keys=True)
            if key not in latest or r.get("date", "") >= latest[key].get("date", ""):
                latest[key] = r
    return list(latest.values())


def _per_compiler_table(title: str, columns: list[str], figures: list[str], rows: list[dict], label, cells) -> list[str]:
    """A section with a line per row and compiler: `label(record)` gives the row's first cells
    (for `columns`, before the compiler's), `cells(f)` the compiler's figures (for `figures`)."""
    out = [f"## {title}", "", "| " + " | ".join([*columns, "compiler", *figures, "commit"]) + " |",
           "|" + "---|" * (len(columns) + 1) + "---:|" * len(figures) + "---|"]
    for r in rows:
        for compiler, f in r["figures"]["compilers"].items():
            values = ["failed"] + [""] * (len(figures) - 1) if "error" in f else cells(f)
            source = r.get("earlier", {}).get(compiler, r)  # (a compiler the latest run left out)
            out.append("| " + " | ".join([*label(r), NAMES.get(compiler, compiler), *values, short_commit(source)]) + " |")
    sources = [*rows, *(e for r in rows for e in r.get("earlier", {}).values())]
    commands = sorted({r.get("command", "") for r in sources})
    return out + ["", "Commands: " + "; ".join(f"`{c}`" for c in commands if c), ""]


def distributed_section(directory: Path | None) -> list[str]:
    """Distributed training (bench/distributed.py): the latest record of each row."""
    rows = _latest_rows("distributed", directory)
    if not rows:
        return []
    return _per_compiler_table(
        "Distributed training (bench/distributed.py)", ["row", "ranks", "where"],
        ["steps/s", "x eager", "cold s", "x torch.compile cold", "peak MiB", "scaling 1 to N", "loss diff"], rows,
        lambda r: [r["row"]["label"], str(r["row"]["world_size"]), short_gpu(r.get("gpu")) or "CPU"],
        lambda f: [f"{f['steps_per_s']:.2f}", fmt(f.get("speedup"), ".2f", "x"), f"{f['cold_s']:.1f}",
                   fmt(f.get("cold_vs_torch"), ".3f"), fmt(f.get("peak_mib"), ".0f"), fmt(f.get("scaling"), ".2f"),
                   fmt(f.get("max_diff"), ".1e")])


def dynamic_sizes_section(directory: Path | None) -> list[str]:
    """Dynamic shapes over many lengths (bench/dynamic_sizes.py, its model rows): each row's
    latest record, and a compiler it left out from the latest record before that has it (its
    own commit on its line)."""
    rows = [_with_earlier_compilers(r, directory) for r in _latest_rows("dynamic_sizes", directory)]
    if not rows:
        return []

    def label(r: dict) -> list[str]:
        row = r["row"]
        return [f"{row['label']} {row.get('phase', '')}, {row.get('lengths')} lengths {row.get('min_len')}-{row.get('max_len')}",
                where(r)]

    return _per_compiler_table(
        "Dynamic shapes: one model over many input lengths (bench/dynamic_sizes.py)", ["row", "where"],
        ["captured graphs", "of them symbolic", "weld compiles", "total s", "first compile s",
         "symbolic compile s (x first)", "mean ms", "x one compile a length", "max diff"], rows, label,
        lambda f: [str(f.get("graphs")), str(f.get("symbolic_graphs")), fmt(f.get("weld_compiles"), "d"),
                   f"{f['total_s']:.1f}", fmt(f.get("first_compile_s"), ".2f"), _symbolic_compile(f),
                   fmt(f.get("mean_ms"), ".2f"), fmt(f.get("mean_ratio_to_static"), ".3f"), fmt(f.get("max_diff"), ".1e")])


def _with_earlier_compilers(latest: dict, directory: Path | None) -> dict:
    """`latest` with the compilers of earlier records of its row that it lacks, newest first:
    under "earlier", the record each came from."""
    key = json.dumps(latest["row"], sort_keys=True)
    earlier = sorted((r for r in records.read("dynamic_sizes", directory=directory)
                      if "row" in r and json.dumps(r["row"], sort_keys=True) == key
                      and r.get("date", "") <= latest.get("date", "")), key=lambda r: r.get("date", ""), reverse=True)
    merged = dict(latest, figures=dict(latest["figures"], compilers=dict(latest["figures"]["compilers"])), earlier={})
    for r in earlier:
        for name, figures in r["figures"]["compilers"].items():
            if name not in merged["figures"]["compilers"]:
                merged["figures"]["compilers"][name] = figures
                merged["earlier"][name] = r
    return merged


def _symbolic_compile(figures: dict) -> str:
    """The calls of the length that first compiled over symbols, and their time over the first
    length's (issue 45's goal for the cold compile over symbols: at most 1.5x)."""
    seconds, first = figures.get("dynamic_compile_s"), figures.get("first_compile_s")
    if seconds is None:
        return "-"
    return f"{seconds:.2f} ({seconds / first:.2f}x)" if first else f"{seconds:.2f}"


def overhead_section(directory: Path | None) -> list[str]:
    """Per-call overhead of tiny compiled functions (bench/overhead.py): its latest record."""
    runs = list(records.read("overhead", directory=directory))
    if not runs:
        return []
    r = max(runs, key=lambda run: run.get("date", ""))
    out = [f"## Per-call overhead of a tiny compiled function ({r.get('cpu') or r.get('host')}, {short_commit(r)})", "",
           "| function | eager us | torch.compile us | torchweld us | torchweld / torch.compile |",
           "|---|---:|---:|---:|---:|"]
    for c in r["figures"]["cases"]:
        out.append(f"| {c['case']} | {c['eager_us']:.2f} | {c['torch_compile_us']:.2f} | {c['torchweld_us']:.2f} "
                   f"| {c['ratio']:.2f} |")
    return out + ["", f"Command: `{r.get('command', '')}` (median of 7 rounds; a noisy 2-core host: compare rows of one record)", ""]


# the order of rows in a table (bench/models.py's names; render.py does not import torch)
MODEL_ORDER = ("chain", "add_mul", "tiny_mlp", "mlp", "cnn", "block", "resnet50", "densenet121", "bert", "gpt2", "llama")


def _order(key: tuple, model: str = "") -> tuple:
    place, phase, step, mode, dtype, label = key
    rank = MODEL_ORDER.index(model) if model in MODEL_ORDER else len(MODEL_ORDER)
    return (place == "CPU", place, phase != "inference", step, mode != "default", mode, dtype, rank, label)


def other_suites(directory: Path | None) -> list[str]:
    """One line per other suite (fuzz, reliability, ...): its latest record."""
    latest: dict[str, dict] = {}
    for r in records.read(directory=directory):
        if "row" not in r and r.get("bench") and r["bench"] not in ("decode", "distributed", "overhead"):
            if r["bench"] not in latest or r.get("date", "") >= latest[r["bench"]].get("date", ""):
                latest[r["bench"]] = r
    if not latest:
        return []
    out = ["## Other suites (the latest record of each)", ""]
    for suite, r in sorted(latest.items()):
        out.append(f"- **{suite}** ({(r.get('date') or '')[:10]}, {short_commit(r)}, {r.get('host', '?')}): "
                   f"{suite_summary(r)}; `{r.get('command', '')}`")
    return out + [""]


def suite_summary(r: dict) -> str:
    figures = r.get("figures")
    if r.get("bench") == "reliability" and isinstance(figures, list):
        good = sum(1 for f in figures if f.get("correct") and f.get("warnings") == f.get("expected_warnings"))
        return f"{good} of {len(figures)} scenarios ended well"
    if isinstance(figures, list):
        return f"{len(figures)} rows"
    if isinstance(figures, dict):
        plain = [f"{k} {v}" for k, v in figures.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
        return ", ".join(plain[:6]) or "figures in the record"
    return "figures in the record"


def readme_table(directory: Path | None = None) -> str:
    recs = [r for r in harness_records(directory)
            if all(r["row"].get(k) == v for k, v in README_DEVICE.items()) and not r.get("options", {}).get("quick")]
    chosen = []
    for title, match in README_ROWS:
        found = [r for r in recs if all(r["row"].get(k) == v for k, v in match.items())]
        if found:
            chosen.append((title, max(found, key=lambda r: r["date"])))
    gpus = sorted({short_gpu(r.get("gpu")) for _, r in chosen}) or ["CUDA"]
    lines = [f"| {' / '.join(gpus)}, float32 | weld | torch.compile | cold, weld / tc | warm s, weld / tc | commit |",
             "|---|---|---|---|---|---|"]
    for title, r in chosen:
        f = r["figures"]["compilers"]
        weld, tc = f.get("torchweld", {}), f.get("torch", {})
        cells = [fmt(weld.get("speedup"), ".2f", "x"), fmt(tc.get("speedup"), ".2f", "x")]
        if cells[0] == cells[1] != "-":  # level at two digits: the times say which is ahead
            cells = [f"{cell} ({fmt(c.get('ms'), '.3f')} ms)" for cell, c in zip(cells, (weld, tc))]
        warm = f"{fmt(weld.get('warm_s'), '.2f')} / {fmt(tc.get('warm_s'), '.2f')}" if "warm_s" in weld else "-"
        lines.append(f"| {title} | {cells[0]} | {cells[1]} | "
                     f"{fmt(weld.get('cold_vs_torch'), '.3f')} | {warm} | {short_commit(r)} |")
    return "\n".join(lines)


def rewrite_readme(text: str, table_text: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    note = "<!-- rendered by `python bench/render.py --readme` from bench/records/: do not edit by hand -->"
    return pattern.sub(lambda _: f"{BEGIN}\n{note}\n\n{table_text}\n\n{END}", text)


def render_diff(a: str, b: str, directory: Path | None = None) -> str:
    recs = harness_records(directory)
    at_a = latest_per_row([r for r in recs if (r.get("commit") or "").startswith(a)])
    at_b = latest_per_row([r for r in recs if (r.get("commit") or "").startswith(b)])
    keys = sorted(set(at_a) & set(at_b), key=lambda k: _order(k, at_a[k]["row"].get("model", "")))
    out = [f"# {a} against {b}", ""]
    if not keys:
        only = len(at_a), len(at_b)
        return "\n".join(out + [f"No row has a record at both commits ({only[0]} rows at {a}, {only[1]} at {b})."]) + "\n"
    compilers = compilers_of([at_a[k] for k in keys] + [at_b[k] for k in keys])
    head = ["row", "where"] + [f"{NAMES.get(c, c)} ms: {a} -> {b}" for c in compilers] + ["weld / tc cold"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        fa, fb = at_a[k]["figures"]["compilers"], at_b[k]["figures"]["compilers"]
        cells = [k[5], section_title(k)]
        for c in compilers:
            ma, mb = (fa.get(c) or {}).get("ms"), (fb.get(c) or {}).get("ms")
            change = f" ({(mb / ma - 1) * 100:+.1f}%)" if ma and mb else ""
            cells.append(f"{fmt(ma, '.3f')} -> {fmt(mb, '.3f')}{change}")
        cells.append(f"{fmt(fa.get('torchweld', {}).get('cold_vs_torch'), '.3f')} -> "
                     f"{fmt(fb.get('torchweld', {}).get('cold_vs_torch'), '.3f')}")
        out.append("| " + " | ".join(cells) + " |")
    hosts = {r.get("host") for r in [*(at_a[k] for k in keys), *(at_b[k] for k in keys)]}
    if len(hosts) > 1:
        out += ["", f"The rows ran on {len(hosts)} hosts ({', '.join(sorted(h or '?' for h in hosts))}): "
                    "times compare across commits only on one host."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="rewrite the table between README.md's markers")
    parser.add_argument("--diff", nargs=2, metavar=("COMMIT_A", "COMMIT_B"))
    parser.add_argument("--records-dir", type=Path, default=None, help="default: bench/records (TORCHWELD_BENCH_RECORDS)")
    parser.add_argument("--out", type=Path, default=None, help="where RESULTS.md (or --readme's README) goes")
    parser.add_argument("--stdout", action="store_true", help="print instead of writing")
    args = parser.parse_args(argv)
    if args.diff:
        print(render_diff(*args.diff, directory=args.records_dir), end="")
        return 0
    if args.readme:
        path = args.out or README
        text = rewrite_readme(path.read_text(), readme_table(args.records_dir))
    else:
        path = args.out or RESULTS
        text = render_results(args.records_dir)
    if args.stdout:
        print(text, end="")
    else:
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
