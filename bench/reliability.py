"""How a torchweld program ends when its disk cache is damaged, when it is interrupted
during its first compile, and when several processes fill one empty cache: each
scenario of tests/reliability.py run in processes of its own, one row each.

    .venv/bin/python bench/reliability.py [--no-record] [--delays 0.1,0.3,0.7,1.2] [--processes 4]

A row says whether the run after the damage (or the interrupt) gave correct results,
how its process ended (a signal name is a crash), and torchweld's warnings against
those expected. The rows are appended to bench/records/reliability.jsonl as one record
(date, commit, host, CPU, versions, command, options, figures), unless --no-record.
Exit status 1 if any scenario did not end well.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: tests.reliability, bench.records
from bench import records  # noqa: E402
from tests.reliability import (  # noqa: E402
    DAMAGES, Outcome, environment, read_only, run_concurrently, run_interrupted, run_program, unwritable_home)


def damage_rows(work: Path) -> list[dict]:
    filled = work / "filled"
    outcome = run_program(filled, "first")
    rows = [row("fill an empty cache", outcome, expected_warnings=0)]
    for name, damage in DAMAGES.items():
        cache = work / name.replace(" ", "_")
        shutil.copytree(filled, cache)
        damage.apply(cache)
        rows.append(row(name, run_program(cache, "first"), expected_warnings=damage.entries))
    return rows


def directory_rows(work: Path) -> list[dict]:
    rows = [row("cache deleted while running", run_program(work / "deleted", "delete"), expected_warnings=1)]
    cache = work / "read_only"
    run_program(cache, "first")
    with read_only(cache) as prefix:
        if prefix is not None:
            rows.append(row("read-only cache, new kernel needed", run_program(cache, prefix=prefix),
                            expected_warnings=1))
    home = unwritable_home()
    try:
        rows.append(row("unwritable HOME, no TORCHWELD_CACHE_DIR",
                        run_program(None, env=environment(None, HOME=str(home)), cwd=work), expected_warnings=1))
    finally:
        home.unlink()
    (work / "home").mkdir(), (work / "cwd").mkdir()
    outcome = run_program("", env=environment("", HOME=str(work / "home")), cwd=work / "cwd")
    rows.append(row('TORCHWELD_CACHE_DIR=""', outcome, expected_warnings=0,
                    error="wrote its cache into the current directory" if any((work / "cwd").iterdir()) else ""))
    if os.geteuid() == 0:  # another user's cache: root can hand one to nobody
        import pwd

        cache = work / "other_user"
        run_program(cache, "first")
        for path in [cache, *cache.rglob("*")]:
            os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
        rows.append(row("another user's cache", run_program(cache), expected_warnings=1))
    return rows


def interrupt_rows(work: Path, delays: list[float]) -> list[dict]:
    rows = []
    for delay in delays:
        outcome = run_interrupted(work / f"interrupt_{delay}", delay)
        when = "during compile" if "interrupted" in outcome.stdout else "after compile"
        rows.append(row(f"SIGINT at {delay:.2f} s ({when})", outcome, expected_warnings=0))
    return rows


def concurrency_rows(work: Path, processes: int) -> list[dict]:
    outcomes = run_concurrently(work / "concurrent", processes)
    worst = next((o for o in outcomes if not o.ok or o.warnings), outcomes[0])
    return [row(f"{processes} processes, one empty cache", worst, expected_warnings=0,
                seconds=max(o.seconds for o in outcomes))]


def row(scenario: str, outcome: Outcome, expected_warnings: int, seconds: float | None = None, error: str = "") -> dict:
    """One scenario's figures; `error`: something wrong besides the process's own end."""
    if not outcome.ok:
        error = outcome.stderr.strip().splitlines()[-1][:160] if outcome.stderr.strip() else "no output"
    return {"scenario": scenario, "correct": outcome.ok and not error,
            "ended": outcome.signal_name or f"exit {outcome.returncode}",
            "warnings": len(outcome.warnings), "expected_warnings": expected_warnings,
            "seconds": round(outcome.seconds if seconds is None else seconds, 2),
            "first_warning": outcome.warnings[0][:160] if outcome.warnings else "", "error": error}


def print_table(rows: list[dict]) -> None:
    print(f"{'scenario':42} {'correct':8} {'ended':8} {'warnings':9} {'s':>6}  first warning / error")
    for r in rows:
        warnings = f"{r['warnings']}/{r['expected_warnings']}"
        print(f"{r['scenario']:42} {str(r['correct']):8} {r['ended']:8} {warnings:9} {r['seconds']:6.2f}  "
              f"{r['error'] or r['first_warning']}")


def append_record(rows: list[dict], options: argparse.Namespace) -> None:
    import torch  # noqa: F401  (records name its build: 2.13.0+cpu)

    records.append("reliability", records.make_record("reliability", rows, options=vars(options)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/records/reliability.jsonl")
    parser.add_argument("--delays", default="0.1,0.3,0.7,1.2", help="seconds into the first call to send SIGINT")
    parser.add_argument("--processes", type=int, default=4, help="processes filling one empty cache at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torchweld-reliability-") as work:
        work = Path(work)
        rows = (damage_rows(work) + directory_rows(work)
                + interrupt_rows(work, [float(d) for d in args.delays.split(",")])
                + concurrency_rows(work, args.processes))
    print_table(rows)
    if not args.no_record:
        append_record(rows, args)
    return 0 if all(r["correct"] and r["warnings"] == r["expected_warnings"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
