"""Property-based: random small programs mixing tensor ops, control flow on tensor
values and on Python values, container mutations and calls that need Python.
Every result and every side effect must equal eager's."""
import copy
import linecache
import textwrap

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchweld
from tests.capture.helpers import assert_same

STATEMENTS = [
    "x = x + y",
    "x = x * y - 1",
    "x = torch.sin(x)",
    "x = torch.relu(x) + x.abs()",
    "y = x * 0.5",
    "if x.sum() > 0:\n    x = x - 1\nelse:\n    y = y + 1",
    "if n > 2:\n    y = y - x",
    "for i in range(2):\n    x = x + i",
    "while x.mean() > 1:\n    x = x * 0.5",
    "acc.append(x * 2)",
    "d['k' + str(n)] = y",
    "print('hello from a random program')",
    "n = n + 1",
    "x.add_(1)",
    "v = x.sum().item()\ny = y + v",
    "lst = [x, y]\nlst.append(x)\nx = lst[-1] + lst[0]",
    "t = (x, n)\nx = t[0] * t[1]",
    "if (y > 0).any() and n < 5:\n    n = n + 2",
    "box.total = box.total + x.sum()",
    "k = int(x.max())\nx = x + k",
]

_counter = [0]


class Box:
    def __init__(self):
        self.total = torch.zeros(())


def _make(statements: list[str]):
    body = "\n".join(statements)
    source = "def program(x, y, n, acc, d, box):\n" + textwrap.indent(body, "    ") + "\n    return x, y, n\n"
    _counter[0] += 1
    filename = f"<random program {_counter[0]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"torch": torch}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["program"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(statements=st.lists(st.sampled_from(STATEMENTS), min_size=1, max_size=6),
       values=st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=3, max_size=3), n=st.integers(0, 4))
def test_random_program_matches_eager(statements, values, n, capsys):
    program = _make(statements)
    compiled = torchweld.compile(program)
    for scale in (1.0, -1.0):  # the second call takes other branches and may fail guards
        x, y = torch.tensor(values) * scale, torch.tensor(values[::-1])
        args = (x, y, n, [], {}, Box())
        eager_args = copy.deepcopy(args)
        out = compiled(*args)
        expected = program(*eager_args)
        assert_same(out, expected)
        assert_same(args[:5], eager_args[:5])  # inputs mutated in place, appended lists, dicts
        assert_same(args[5].total, eager_args[5].total)
