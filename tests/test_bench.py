"""bench/ stays runnable: the harness measures a tiny model on the CPU with eager and
torchweld, each in a fresh process, and appends a record; render.py makes the results page,
the README's table and a diff between commits from records."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import render

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_harness_records_a_row_and_render_shows_it(tmp_path):
    run("bench/harness.py", "--device", "cpu", "--only", "tiny_mlp", "--compilers", "eager,torchweld", "--cold",
        "--repeat", "2", "--min-time", "0.1", "--records-dir", str(tmp_path))
    [record] = [json.loads(line) for line in (tmp_path / "models.jsonl").read_text().splitlines()]
    assert record["bench"] == "models" and record["source"] == "run"
    for key in ("commit", "host", "cpu", "cores", "python", "versions", "command", "date"):
        assert record[key], key
    assert record["versions"]["torch"] and record["gpu"] is None
    assert "bench/harness.py" in record["command"] and "--only tiny_mlp" in record["command"]
    assert record["row"] == {"model": "tiny_mlp", "label": "tiny MLP d16 b8", "phase": "inference", "step": None,
                             "mode": "default", "device": "cpu", "dtype": "float32"}
    eager, weld = record["figures"]["compilers"]["eager"], record["figures"]["compilers"]["torchweld"]
    assert "error" not in weld, weld
    assert eager["ms"] > 0 and weld["ms"] > 0 and weld["cold_s"] > 0 and len(weld["rounds_ms"]) == 2
    assert weld["speedup"] == eager["ms"] / weld["ms"]
    assert weld["max_diff"] < 1e-4  # the first output against eager's

    page = run("bench/render.py", "--records-dir", str(tmp_path), "--stdout").stdout
    assert "## CPU, inference, default mode, float32" in page
    [line] = [ln for ln in page.splitlines() if ln.startswith("| tiny MLP d16 b8 |")]
    assert record["commit"][:7] in line and f"({weld['speedup']:.2f}x)" in line

    commit = record["commit"][:10]
    diff = run("bench/render.py", "--records-dir", str(tmp_path), "--diff", commit, commit).stdout
    assert "| tiny MLP d16 b8 |" in diff and "(+0.0%)" in diff


def record(date: str, commit: str, weld_ms: float, **row) -> dict:
    row = {"model": "resnet50", "label": "resnet50 b32", "phase": "inference", "step": None, "mode": "default",
           "device": "cuda", "dtype": "float32", **row}
    return {"bench": "models", "source": "run", "date": date, "commit": commit, "dirty": False, "host": "h",
            "gpu": "NVIDIA H100 80GB HBM3", "command": "python bench/harness.py", "options": {}, "row": row,
            "figures": {"compilers": {"eager": {"ms": 6.0, "speedup": 1.0},
                                      "torch": {"ms": 3.0, "speedup": 2.0, "cold_s": 20.0},
                                      "torchweld": {"ms": weld_ms, "speedup": 6.0 / weld_ms, "cold_s": 2.0,
                                                    "cold_vs_torch": 0.1}}}}


def test_latest_record_per_row_readme_table_and_diff(tmp_path):
    lines = [record("2026-01-01T00:00:00+00:00", "a" * 40, 4.0),
             record("2026-01-02T00:00:00+00:00", "b" * 40, 2.0),
             record("2026-01-02T00:00:00+00:00", "b" * 40, 1.0, model="bert", label="BERT b8 s128",
                    mode="reduce-overhead")]
    (tmp_path / "models.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    page = render.render_results(tmp_path)
    assert "| resnet50 b32 | 6.000 | 3.000 (2.00x) | 2.000 (3.00x) |" in page  # the latest, not the first
    assert "4.000" not in page

    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nbefore\n<!-- results:begin -->\nold table\n<!-- results:end -->\nafter\n")
    render.main(["--readme", "--records-dir", str(tmp_path), "--out", str(readme)])
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n<!-- results:begin -->") and text.endswith("<!-- results:end -->\nafter\n")
    assert "old table" not in text
    assert "| H100, float32 | weld | torch.compile | cold, weld / tc | warm s, weld / tc | commit |" in text
    assert "| resnet50 b32 inference | 3.00x | 2.00x | 0.100 | - | bbbbbbb |" in text
    assert "| reduce-overhead: BERT inference | 6.00x | 2.00x | 0.100 | - | bbbbbbb |" in text

    diff = render.render_diff("aaaa", "bbbb", tmp_path)
    assert "| resnet50 b32 |" in diff and "4.000 -> 2.000 (-50.0%)" in diff and "BERT" not in diff


def test_the_repositorys_own_records_render():
    """Every suite's records in bench/records render (other suites' rows once broke the harness table)."""
    page = run("bench/render.py", "--stdout").stdout
    assert "## Other suites" in page


@pytest.mark.parametrize("model, title", [("gpt-fast", "tiny Llama-style decoder"),
                                          ("transformers", "tiny transformers' LlamaForCausalLM (StaticCache)")])
def test_decode_benchmark_records_tokens_per_second_and_render_shows_them(tmp_path, model, title):
    """bench/decode.py on the CPU with its tiny decoder (gpt-fast's, or transformers' Llama with
    its StaticCache): eager and torchweld in fresh processes, a record with ms a token and the
    logits' difference, rendered as RESULTS.md's decoding table."""
    import os

    env = {**os.environ, "TORCHWELD_BENCH_RECORDS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "bench/decode.py", "--device", "cpu", "--preset", "tiny", "--batch", "1",
                           "--model", model,
                           "--compilers", "eager,torchweld", "--mode", "default", "--tokens", "3", "--repeat", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [rec] = [json.loads(line) for line in (tmp_path / "decode.jsonl").read_text().splitlines()]
    eager, weld = rec["figures"]["rows"]
    assert "error" not in weld, weld
    assert weld["compiler"] == "torchweld" and weld["ms"] > 0 and weld["max_diff"] < 1e-2
    page = run("bench/render.py", "--records-dir", str(tmp_path), "--stdout").stdout
    assert f"## LLM decoding: {title}, bfloat16" in page
    assert any(line.startswith("| torchweld | 1 |") for line in page.splitlines())


def test_distributed_and_dynamic_sizes_sections(tmp_path):
    """The latest record of each distributed and dynamic-sizes row becomes a table row a compiler."""
    common = {"source": "run", "commit": "c" * 40, "dirty": False, "host": "h", "gpu": "NVIDIA H100 80GB HBM3",
              "options": {}}
    ddp = {**common, "bench": "distributed", "date": "2026-01-01T00:00:00+00:00", "command": "python bench/distributed.py",
           "row": {"model": "ddp_gpt2", "label": "DDP GPT-2", "parallel": "DDP", "world_size": 2, "device": "cuda",
                   "dtype": "float32"},
           "figures": {"compilers": {"eager": {"steps_per_s": 10.0, "speedup": 1.0, "cold_s": 1.0},
                                     "torchweld": {"steps_per_s": 12.5, "speedup": 1.25, "cold_s": 5.0,
                                                   "scaling": 1.97, "max_diff": 1e-6}}}}
    dyn = {**common, "bench": "dynamic_sizes", "date": "2026-01-01T00:00:00+00:00",
           "command": "python bench/dynamic_sizes.py",
           "row": {"model": "gpt2", "label": "GPT-2 b8", "phase": "inference", "device": "cuda", "lengths": 16,
                   "min_len": 32, "max_len": 512},
           "figures": {"lengths": [32], "compilers": {"torchweld": {"graphs": 2, "symbolic_graphs": 1,
                                                                    "weld_compiles": 16, "total_s": 23.8,
                                                                    "mean_ratio_to_static": 1.006}}}}
    (tmp_path / "distributed.jsonl").write_text(json.dumps(ddp) + "\n")
    (tmp_path / "dynamic_sizes.jsonl").write_text(json.dumps(dyn) + "\n")
    page = render.render_results(tmp_path)
    assert "| DDP GPT-2 | 2 | H100 | torchweld | 12.50 | 1.25x | 5.0 | - | - | 1.97 | 1.0e-06 | ccccccc |" in page
    assert "| GPT-2 b8 inference, 16 lengths 32-512 | H100 | torchweld | 2 | 1 | 16 | 23.8 |" in page
    assert "**distributed**" not in page and "**dynamic_sizes**" not in page  # not again among the other suites


def test_with_constants_runs_a_script_with_tuning_fields_changed(tmp_path):
    """bench/with_constants.py sets fields of torchweld.tuning before the script runs, with
    the field's type; an unknown field or a value of the wrong type is an error."""
    script = tmp_path / "show.py"
    script.write_text("import sys\nfrom torchweld.tuning import tuning\n"
                      "print('seen', tuning.row_block_elements, tuning.chunk_steps, sys.argv[1:])\n")
    out = run("bench/with_constants.py", "row_block_elements=4096", "--", str(script), "a", "b").stdout
    assert "tuning.row_block_elements = 4096" in out and "seen 4096 32 ['a', 'b']" in out
    for setting, error in [("ROW_BLOCK_ELEMENTS=4096", "tuning has no field 'ROW_BLOCK_ELEMENTS'; its fields: "),
                           ("row_block_elements=4k", "row_block_elements=4k: row_block_elements is int")]:
        proc = subprocess.run([sys.executable, "bench/with_constants.py", setting, "--", str(script)], cwd=ROOT,
                              capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode != 0 and error in proc.stderr and "seen" not in proc.stdout, proc.stderr


def test_a_compiler_left_out_of_a_rows_latest_run_shows_from_the_run_before(tmp_path):
    """dynamic_sizes rows: the latest record's compilers, and one it lacks from the record
    before that has it, each line with the commit it was measured at."""
    import json

    row = {"model": "gpt2", "label": "GPT-2 b8", "phase": "inference", "device": "cuda", "batch": 8,
           "dtype": "float32", "lengths": 16, "min_len": 32, "max_len": 512}

    def figures(total):
        return {"graphs": 2, "symbolic_graphs": 1, "total_s": total, "first_compile_s": 1.0,
                "dynamic_compile_s": 1.5, "mean_ms": 12.0, "max_diff": 1e-5}

    older = {"row": row, "date": "2026-11-27", "commit": "a" * 40,
             "figures": {"compilers": {"torchweld": figures(5.0), "torch": figures(40.0)}}}
    newer = {"row": row, "date": "2026-11-28", "commit": "b" * 40,
             "figures": {"compilers": {"torchweld": figures(4.0)}}}
    (tmp_path / "dynamic_sizes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (older, newer)))
    lines = [line for line in render.dynamic_sizes_section(tmp_path) if line.startswith("| GPT-2")]
    assert len(lines) == 2
    assert "| torchweld |" in lines[0] and "| 4.0 |" in lines[0] and lines[0].endswith("| bbbbbbb |")
    assert "| torch.compile |" in lines[1] and "| 40.0 |" in lines[1] and lines[1].endswith("| aaaaaaa |")


def test_with_constants_changes_reach_the_benchmark_workers(monkeypatch):
    """bench/with_constants.py hands its tuning changes to workers in TORCHWELD_BENCH_TUNING,
    which a worker applies (bench/runner.py) before it compiles."""
    from bench import runner
    from torchweld.tuning import tuning

    monkeypatch.setenv(runner.TUNING_VARIABLE, json.dumps({"opaque_attention_over_symbols": True, "block_s": 32}))
    with tuning.patch(opaque_attention_over_symbols=False, block_s=64):
        runner.apply_tuning_changes()
        assert tuning.opaque_attention_over_symbols is True and tuning.block_s == 32
