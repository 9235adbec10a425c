"""Differential fuzzing: generated programs (tests/fuzz/program.py), each compiled and
called 4-6 times with other tensors, scalars and program state between calls; every call
must return, raise, print and change what eager does (tests/fuzz/driver.py).

Hypothesis draws one case seed per example and the grammar draws the program from it
(hypothesis's own draws through the grammar repeated half the programs and halved the
rate of most features); derandomized, without an example database, and every call
seeds torch: the same programs on every run. A failure prints the program, its calls,
the difference, a standalone script, and the command that runs it again and shrinks it
(`python -m tests.fuzz.run --case N --backend B --minimize`).

TORCHWELD_FUZZ_EXAMPLES=2 runs twice as many programs (any factor). TORCHWELD_FUZZ_SHRINK=1
draws the grammar's choices through hypothesis instead, and lets it shrink a failure
(other programs than the default run, minutes to shrink). Big runs: tests/fuzz/README.md."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz.draw import HypothesisDraw
from tests.fuzz.driver import run_case
from tests.fuzz.program import case_from_seed, generate_case

SCALE = float(os.environ.get("TORCHWELD_FUZZ_EXAMPLES", "1"))
SHRINK = bool(os.environ.get("TORCHWELD_FUZZ_SHRINK"))


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, round(examples * SCALE)), derandomize=True, database=None, deadline=None,
                    phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if SHRINK else []),
                    suppress_health_check=list(HealthCheck), print_blob=False)


def check(data, backend: str) -> None:
    if SHRINK:
        case = generate_case(HypothesisDraw(data), backend, origin="hypothesis draws (TORCHWELD_FUZZ_SHRINK=1)")
    else:
        case = case_from_seed(data.draw(st.integers(0, 2**32 - 1), label="case seed"), backend)
    outcome = run_case(case)
    if outcome.differences:
        pytest.fail(f"{outcome.report()}\n=== standalone script ===\n{case.script()}", pytrace=False)


@fuzz_settings(examples=200)
@given(data=st.data())
def test_capture_only_programs_match_eager(data):
    check(data, "eager")


@fuzz_settings(examples=25)
@given(data=st.data())
def test_weld_programs_match_eager(data):
    check(data, "weld")
