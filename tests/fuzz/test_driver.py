"""The fuzzer's driver finds what it is meant to find: backends that get a call wrong in
each way it compares (outputs, in-place changes to arguments, aliasing, state) are caught,
and a correct backend passes the same cases."""
from __future__ import annotations

import torch

from tests.fuzz.case import Call, Case
from tests.fuzz.driver import run_case

SOURCE = """\
import torch

G_SEEN = []


def f(x, lst, n=2):
    x.add_(1)
    lst.append(n)
    y = x * n
    G_SEEN.append(n)
    return x, y
"""
CALLS = tuple(Call(args=f"R = {rows}\nx = torch.ones(R, 4)\nargs = (x, [])\nkwargs = {{}}", seed=i,
                   changes="f.__defaults__ = (3,)" if i == 2 else "")
              for i, rows in enumerate((2, 2, 3, 3)))
CASE = Case(source=SOURCE, calls=CALLS, origin="test_driver")


def wrong_output_backend(gm, example_inputs):
    def run(*args):
        out = gm.forward(*args)
        return [o + 1 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out]
    return run


def cloning_backend(gm, example_inputs):  # in-place changes to inputs are lost, outputs copies
    return lambda *args: gm.forward(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])


def test_a_correct_backend_passes():
    graphs = []
    outcome = run_case(CASE, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)
    assert not outcome.differences, outcome.report()
    assert outcome.calls == 4 and graphs  # compared on every call, and compiled (not run eagerly)


def test_wrong_outputs_are_found():
    outcome = run_case(CASE, backend=wrong_output_backend)
    assert outcome.differences and outcome.differences[0].call == 0, outcome.report()


def test_lost_input_changes_are_found():
    outcome = run_case(CASE, backend=cloning_backend)
    whats = {d.what for d in outcome.differences}
    assert whats & {"arguments", "aliasing", "output", "printed", "state"}, outcome.report()
