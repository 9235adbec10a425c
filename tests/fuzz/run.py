"""Big differential-fuzzing runs: many generated programs, each compared with eager on
every call, in worker processes that are replaced when one crashes (a segfault in the
compiler) or hangs; prints counts and appends a record to bench/records/fuzz.jsonl.

    python -m tests.fuzz.run --programs 10000 --backend eager
    python -m tests.fuzz.run --programs 2000 --backend mixed --weld-share 0.2
    python -m tests.fuzz.run --case 17 --backend eager              # one program, here
    python -m tests.fuzz.run --case 17 --backend eager --minimize   # ... made smaller

Program i of a run is case seed `seed * 1_000_000 + i`; each failure's report (program,
calls, difference, standalone script) goes to --out, named by kind and case seed.
"""
from __future__ import annotations

import argparse
import collections
import logging
import multiprocessing
import multiprocessing.connection
import shlex
import sys
import time
from pathlib import Path

from tests.fuzz.program import case_from_seed



# -- the worker ----------------------------------------------------------------------------

def _quiet_worker(raise_internal_errors: bool) -> None:
    import warnings

    import torch

    import torchweld

    warnings.simplefilter("ignore")  # cache-limit and graph-break warnings, thousands of them
    logging.getLogger("torchweld").setLevel(logging.ERROR)  # weld's "running it eagerly" lines, too
    torch.set_num_threads(1)
    torchweld.config.raise_internal_errors = raise_internal_errors


def run_one(case_seed: int, backend: str) -> dict:
    """One program, compared with eager; a dict the parent can take through a pipe."""
    from tests.fuzz.driver import GeneratorError, run_case

    start = time.perf_counter()
    case = case_from_seed(case_seed, backend)
    try:
        outcome = run_case(case)
        result = {"kind": outcome.kind, "calls": outcome.calls, "eager_raised": outcome.eager_raised,
                  "signature": outcome.signature, "differences": [str(d) for d in outcome.differences]}
    except GeneratorError as e:
        result = {"kind": "generator", "calls": 0, "signature": f"generator: {e}", "differences": [str(e)]}
    result.update(case_seed=case_seed, backend=backend, seconds=time.perf_counter() - start)
    return result


def worker_main(conn, raise_internal_errors: bool) -> None:
    _quiet_worker(raise_internal_errors)
    while (task := conn.recv()) is not None:
        conn.send(run_one(*task))


class Worker:
    """A process running programs one at a time, told each through a pipe."""

    def __init__(self, ctx, options):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, options.raise_internal_errors), daemon=True)
        self.process.start()
        child.close()
        self.task: tuple[int, str] | None = None
        self.started = 0.0
        self.done = 0

    def give(self, task: tuple[int, str]) -> None:
        self.task, self.started = task, time.monotonic()
        self.conn.send(task)

    def answer(self) -> dict | None:
        """The result of its task if it has sent it; None if not yet (or it died)."""
        if not self.conn.poll():
            return None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def stop(self, kill: bool = False) -> None:
        if not kill:
            try:
                self.conn.send(None)
                self.process.join(timeout=5)
            except (BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# -- the parent -------------------------------------------------------------------------------

def backend_of(index: int, options) -> str:
    if options.backend != "mixed":
        return options.backend
    return "weld" if index % 100 < round(options.weld_share * 100) else "eager"


def run_pool(options) -> list[dict]:
    """Every program of the run, on `options.workers` processes. A worker that dies is
    replaced and its program recorded as a crash; one that passes the timeout is killed
    and its program recorded as a timeout; each retires after programs_per_worker."""
    ctx = multiprocessing.get_context("spawn")
    tasks = collections.deque((options.seed * 1_000_000 + i, backend_of(i, options)) for i in range(options.programs))
    workers = [Worker(ctx, options) for _ in range(min(options.workers, len(tasks)))]
    results: list[dict] = []
    last_progress = time.monotonic()
    try:
        for w in workers:
            w.give(tasks.popleft())
        while any(w.task for w in workers):
            busy = [w for w in workers if w.task]
            multiprocessing.connection.wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=1.0)
            for i, w in enumerate(workers):
                if w.task is None:
                    continue
                result = w.answer()
                if result is None and w.process.is_alive() and time.monotonic() - w.started <= options.timeout:
                    continue  # still working
                if result is None:
                    seed, backend = w.task
                    if w.process.is_alive():
                        result = crash_result(seed, backend, f"timeout: no answer in {options.timeout:g} s", "timeout")
                    else:
                        result = crash_result(seed, backend, f"worker died (exit code {w.process.exitcode})")
                results.append(result)
                if result["kind"] != "ok":
                    write_report(result, options)
                w.task, w.done = None, w.done + 1
                if result["kind"] in ("crash", "timeout") or w.done >= options.programs_per_worker:
                    w.stop(kill=result["kind"] in ("crash", "timeout"))
                    workers[i] = w = Worker(ctx, options)
                if tasks:
                    w.give(tasks.popleft())
            if time.monotonic() - last_progress > options.progress_s:
                last_progress = time.monotonic()
                print(progress_line(results, options.programs), flush=True)
    finally:
        for w in workers:
            w.stop()
    return results


def crash_result(case_seed: int, backend: str, detail: str, kind: str = "crash") -> dict:
    return {"kind": kind, "calls": 0, "case_seed": case_seed, "backend": backend, "seconds": 0.0,
            "signature": f"{kind}: {detail.split(' (')[0]}", "differences": [detail]}


def write_report(result: dict, options) -> None:
    case = case_from_seed(result["case_seed"], result["backend"])
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{result['kind']}-{result['backend']}-{result['case_seed']}"
    text = case.report() + "=== differences ===\n" + "\n".join(result["differences"]) + "\n"
    (out / f"{name}.txt").write_text(text)
    (out / f"{name}.py").write_text(case.script())
    (out / f"{name}.json").write_text(case.to_json())


def progress_line(results: list[dict], total: int) -> str:
    kinds = collections.Counter(r["kind"] for r in results)
    return f"{len(results)}/{total} programs: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common())


def summarize(results: list[dict], seconds: float) -> dict:
    kinds = collections.Counter(r["kind"] for r in results)
    differences = sum(n for k, n in kinds.items() if k not in ("ok", "crash", "timeout", "generator"))
    signatures = collections.Counter(r["signature"] for r in results if r["kind"] != "ok")
    examples = {}
    for r in results:
        examples.setdefault(r["signature"], (r["case_seed"], r["backend"]))
    return {  # the first six plain figures are bench/render.py's one-line summary
        "programs": len(results),
        "calls": sum(r["calls"] for r in results),
        "differences": differences,
        "crashes": kinds["crash"],
        "timeouts": kinds["timeout"],
        "ok": kinds["ok"],
        "programs_eager": sum(r["backend"] == "eager" for r in results),
        "programs_weld": sum(r["backend"] == "weld" for r in results),
        "generator_errors": kinds["generator"],
        "by_kind": dict(kinds.most_common()),
        "distinct_signatures": len(signatures),
        "top_signatures": [{"count": n, "signature": s[:300], "example": "--case %d --backend %s" % examples[s]}
                           for s, n in signatures.most_common(25)],
        "seconds": round(seconds, 1),
        "programs_per_second": round(len(results) / seconds, 2) if seconds else None,
    }


def print_summary(figures: dict) -> None:
    print(f"programs {figures['programs']} (eager {figures['programs_eager']}, weld {figures['programs_weld']}), "
          f"calls {figures['calls']}, ok {figures['ok']}, differences {figures['differences']}, "
          f"crashes {figures['crashes']}, timeouts {figures['timeouts']}, "
          f"generator errors {figures['generator_errors']}, {figures['seconds']} s "
          f"({figures['programs_per_second']} programs/s)")
    print("by kind: " + ", ".join(f"{k} {n}" for k, n in figures["by_kind"].items()))
    print(f"distinct failure signatures: {figures['distinct_signatures']}")
    for row in figures["top_signatures"]:
        print(f"  {row['count']:6}  {row['signature'][:150]}   ({row['example']})")


def append_record(figures: dict, options) -> None:
    """One record in bench/records/fuzz.jsonl, written as every bench suite writes them."""
    from bench import records

    argv = sys.argv[1:]
    command = (records.command_line() if sys.argv[0].endswith("fuzz.py")
               else "python -m tests.fuzz.run " + " ".join(shlex.quote(a) for a in argv))
    path = records.append("fuzz", records.make_record(
        "fuzz", figures, options={k: v for k, v in vars(options).items() if k != "out"}, command=command))
    print(f"appended a record to {path}")


# -- one case, in this process ----------------------------------------------------------------

def run_single(options) -> int:
    from tests.fuzz.case import Case
    from tests.fuzz.driver import run_case
    from tests.fuzz.minimize import crashes_in_subprocess, minimize, same_failure_here

    _quiet_worker(options.raise_internal_errors)
    if options.case_json:
        case = Case.from_json(Path(options.case_json).read_text())
    else:
        case = case_from_seed(options.case, options.backend)
    if options.minimize and options.crash:
        print(case.report() + "=== minimizing (each candidate in a fresh process) ===")
        small = minimize(case, crashes_in_subprocess(), budget_s=options.timeout * 30, log=print)
        if options.save:
            Path(options.save).write_text(small.to_json())
        print(small.report() + "=== standalone script ===\n" + small.script())
        return 0
    outcome = run_case(case)
    print(outcome.report())
    if options.script:
        print("=== standalone script ===\n" + case.script())
    if outcome.differences and options.minimize:
        print("=== minimizing ===")
        small = minimize(case, same_failure_here(case), budget_s=options.timeout * 10, log=print)
        print(run_case(small).report())
        if options.save:
            Path(options.save).write_text(small.to_json())
        print("=== standalone script ===\n" + small.script())
    return 1 if outcome.differences else 0


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=1000, help="programs to generate and run (default 1000)")
    parser.add_argument("--backend", choices=["eager", "weld", "mixed"], default="eager",
                        help="the capture-only backend, weld, or both (--weld-share of the programs on weld)")
    parser.add_argument("--weld-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0, help="program i is case seed seed * 1_000_000 + i")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one program may take")
    parser.add_argument("--programs-per-worker", type=int, default=300, help="a worker is replaced after so many")
    parser.add_argument("--out", default="/tmp/torchweld-fuzz", help="where failing programs' reports go")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/records/fuzz.jsonl")
    parser.add_argument("--allow-internal-errors", dest="raise_internal_errors", action="store_false",
                        help="run capture as users get it: an internal error falls back to eager with a warning "
                             "(default: raised, as in the test suite)")
    parser.add_argument("--progress-s", type=float, default=30.0)
    parser.add_argument("--case", type=int, help="run this one case seed here and print its report")
    parser.add_argument("--case-json", help="run the case saved in this file (reports save one each) here")
    parser.add_argument("--crash", action="store_true",
                        help="with --minimize: the case kills its process; candidates run in fresh processes")
    parser.add_argument("--minimize", action="store_true", help="with --case: shrink a failing case")
    parser.add_argument("--script", action="store_true", help="with --case: print the standalone script")
    parser.add_argument("--save", help="with --minimize: write the smaller case here (JSON, for --case-json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    if options.case is not None or options.case_json:
        if options.backend == "mixed":
            raise SystemExit("--case needs --backend eager or weld")
        return run_single(options)
    start = time.monotonic()
    results = run_pool(options)
    figures = summarize(results, time.monotonic() - start)
    print_summary(figures)
    print(f"reports of failing programs: {options.out}")
    if not options.no_record:
        append_record(figures, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
