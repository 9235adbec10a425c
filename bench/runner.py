"""The plumbing the benchmark scripts share (issue 48): bench/harness.py, bench/dynamic_sizes.py
and bench/distributed.py use all of it; bench/decode.py `COMPILERS`, `sync`, `empty_caches` and
`worker_env`.

- A compiler's job in a fresh Python process: the script runs again with `--worker JOB` (JSON)
  and prints its figures on a line `RESULT {...}` (`answer_job`, `result_line`), which
  `in_fresh_process` reads back; `worker_command` and `worker_env` (with `empty_caches`: empty
  torchweld, Triton and Inductor cache directories) also start distributed.py's ranks.
- `compile_with`: a function as eager, torch.compile or torchweld compiles it; `sync`.
- The command line: the options every script has, the device, the options a record keeps.
- The tables: `fmt` a cell, `summary` a progress line, `print_rows` a line a compiler.

Importing it imports no torch (its functions do, when called), so that a script can call
`set_omp_wait_passive` before torch is imported.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILERS = ("eager", "torch", "torchweld")
RESULT = "RESULT "  # starts the line on which a worker prints its figures (JSON)


def set_omp_wait_passive() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment sets it; before torch is imported, and the
    workers inherit it. OpenMP threads that spin while waiting wait long for one the shared
    machine descheduled: a tiny training step took 200 ms instead of 1.5 on the 2-core machine.
    Every CPU row of the diary ran with PASSIVE."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# =============================================================================
# One compiler's job in a fresh process
# =============================================================================


def empty_caches(root: str, name: str) -> dict[str, str]:
    """Cache directories of torchweld, Triton and Inductor under root/name, as the environment
    variables that set them: empty until the processes given them fill them."""
    folder = os.path.join(root, name)
    return {"TORCHWELD_CACHE_DIR": os.path.join(folder, "torchweld"),
            "TRITON_CACHE_DIR": os.path.join(folder, "triton"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")}


_compiled_sources: list[bool] = []


def compile_package_sources() -> None:
    """torchweld's modules compiled to bytecode (`__pycache__`) once, before any worker runs, as
    `pip install` does for an installed package (torch's are): a checkout run with
    PYTHONDONTWRITEBYTECODE=1, or copied afresh to a GPU host, compiled each module it imported
    in every worker, 0.2-0.3 s of each cold and warm first call on the H100 host."""
    if not _compiled_sources:
        import compileall

        compileall.compile_dir(str(ROOT / "torchweld"), quiet=1)
        _compiled_sources.append(True)


def worker_env(caches: dict[str, str] | None) -> dict[str, str]:
    """This process's environment for a worker: with `caches` as its cache directories (None:
    the user's), without TORCHWELD_BENCH_RECORDS (the parent writes the records). torchweld's
    modules are compiled to bytecode first (compile_package_sources)."""
    compile_package_sources()
    env = dict(os.environ)
    env.pop("TORCHWELD_BENCH_RECORDS", None)
    env.update(caches or {})
    return env


TUNING_VARIABLE = "TORCHWELD_BENCH_TUNING"  # bench/with_constants.py's changes, as JSON, for workers


def apply_tuning_changes() -> None:
    """In a worker: the fields of torchweld's tuning that bench/with_constants.py changed in the
    process that started it (TORCHWELD_BENCH_TUNING), changed here too."""
    text = os.environ.get(TUNING_VARIABLE)
    if text:
        from torchweld.tuning import tuning

        for name, value in json.loads(text).items():
            setattr(tuning, name, value)


def worker_command(script: str, job: dict, flag: str = "--worker") -> list[str]:
    """The command line that runs `job` in `script`, passed as JSON after `flag`."""
    return [sys.executable, str(Path(script).resolve()), flag, json.dumps(job)]


def result_line(result: dict) -> str:
    return RESULT + json.dumps(result)


def answer_job(run_worker, job: str) -> int:
    """A worker's part: run_worker(the JSON `job`), its figures printed on the RESULT line; the
    worker's exit status, 0 (a failure raises)."""
    apply_tuning_changes()
    print(result_line(run_worker(json.loads(job))), flush=True)
    return 0


@contextlib.contextmanager
def killed_after(proc: subprocess.Popen, timeout: float | None):
    """Kills `proc` once `timeout` seconds have passed, even while it prints nothing (None: never)."""
    if timeout is None:
        yield
        return
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def in_fresh_process(script: str, job: dict, caches: dict[str, str] | None, timeout: float | None = None) -> dict:
    """`script --worker JOB` in a process of its own, with `caches` as its cache directories
    (None: the user's); the lines it prints besides its RESULT are printed here as they come,
    indented. Its figures, or {"error": ...} where it failed or, given `timeout` (the script's
    --worker-timeout), ran longer."""
    result = None
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(worker_command(script, job), stdout=subprocess.PIPE, stderr=err, text=True,
                                env=worker_env(caches), cwd=ROOT)
        with killed_after(proc, timeout):
            for line in proc.stdout:
                if line.startswith(RESULT):
                    result = json.loads(line[len(RESULT):])
                else:
                    print("    " + line.rstrip(), flush=True)
            proc.wait()
        if result is None and proc.returncode == -9 and timeout is not None:
            return {"error": f"killed after --worker-timeout {timeout:.0f} s (or for memory)"}
        if proc.returncode or result is None:
            err.seek(0)
            tail = err.read().strip().splitlines()[-3:]
            return {"error": f"exit {proc.returncode}: " + " | ".join(tail)[-400:]}
    return result


# =============================================================================
# Compiling and timing
# =============================================================================


def compile_with(compiler: str, fn, **kwargs):
    """`fn` as `compiler` compiles it: eager leaves it as it is; torch (torch.compile) and
    torchweld (torchweld.compile) forget what they compiled before, then compile it with `kwargs`."""
    if compiler == "eager":
        return fn
    if compiler == "torch":
        import torch

        torch._dynamo.reset()
        return torch.compile(fn, **kwargs)
    if compiler == "torchweld":
        import torchweld

        torchweld.reset()
        return torchweld.compile(fn, **kwargs)
    raise SystemExit(unknown_compiler([compiler], COMPILERS))


def sync(device: str) -> None:
    """Waits for the work queued on a CUDA device (the CPU's is done when a call returns)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# =============================================================================
# The command line
# =============================================================================


def add_device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda where there is one")


def add_record_and_worker_options(parser: argparse.ArgumentParser, worker_flag: str = "--worker") -> None:
    """The options every script ends with: --records-dir, --no-record, and the hidden one its
    workers are started with (worker_command's `flag`)."""
    parser.add_argument("--records-dir", default=None, help="another records directory (tests)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument(worker_flag, default=None, help=argparse.SUPPRESS)


def comma_separated(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def unknown_compiler(names: list[str], known) -> str | None:
    """What to say of the first of `names` that is not among `known`; None where all are."""
    bad = next((name for name in names if name not in known), None)
    return None if bad is None else f"unknown compiler {bad!r}; known: {', '.join(known)}"


def pick_device(requested: str | None) -> str:
    """--device, or cuda where there is one; a SystemExit for --device cuda without one."""
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return device


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's threads: what a run's first line says it ran on."""
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"


def use_records_dir(directory: str | None) -> None:
    """--records-dir: records go there rather than to bench/records (bench/records.py)."""
    if directory:
        os.environ["TORCHWELD_BENCH_RECORDS"] = directory


def record_options(args: argparse.Namespace) -> dict:
    """The parsed options a record keeps: all but --records-dir and a worker's hidden one."""
    return {k: v for k, v in vars(args).items() if k not in ("worker", "rank_job", "records_dir")}


# =============================================================================
# Figures and tables
# =============================================================================


def take_shared(figures: dict[str, dict], key: str):
    """figures[compiler][key] of the first compiler that has it (None where none has), taken out
    of every compiler's figures: what the row's processes all report, such as its label."""
    values = [f.pop(key) for f in figures.values() if key in f]
    return values[0] if values else None


def fmt(value, spec: str) -> str:
    """A table's cell: `value` formatted, or "-" where there is none."""
    return "-" if value is None else format(value, spec)


def summary(f: dict, keys: tuple[str, ...]) -> str:
    """A progress line's figures: "key value" for each of `keys` that `f` has."""
    return ", ".join(f"{k} {f[k]:.3f}" for k in keys if f.get(k) is not None)


def print_rows(figures: dict[str, dict], width: int, cells, error_chars: int = 200) -> None:
    """A table's line a compiler: its name in `width` columns, then cells(its figures), or why it failed."""
    for name, f in figures.items():
        print(f"{name:{width}s} " + (f"failed: {f['error'][:error_chars]}" if "error" in f else cells(f)))
