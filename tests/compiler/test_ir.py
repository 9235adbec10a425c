"""Loop-IR expressions: the per-node memos of loads() and variables() against a plain walk."""
import random

import torch

from torchweld.compiler import ir
from torchweld.compiler.ir import Expr, Op


def _random_dag(rng: random.Random) -> Expr:
    """An expression whose subtrees are shared, as lowering's are, with loads at every depth."""
    pool = [Expr(Op.LOAD, torch.float32, (ir.const(rng.randrange(5)),), f"b{i}") for i in range(4)]
    pool += [ir.var(f"x{i}") for i in range(3)]
    for _ in range(30):
        pool.append(Expr(rng.choice([Op.ADD, Op.MUL]), torch.float32, (rng.choice(pool), rng.choice(pool))))
        if rng.random() < 0.3:
            pool.append(Expr(Op.LOAD, torch.float32, (rng.choice(pool),), f"c{len(pool)}"))
    return pool[-1]


def test_memoized_loads_and_variables_are_what_a_walk_finds():
    """loads() keeps walk's order (it decides kernel argument order) and lists each load once."""
    rng = random.Random(0)
    for _ in range(200):
        e = _random_dag(rng)
        walked = list(ir.walk(e))
        for _ in range(2):  # the second call reads the memo
            assert [id(n) for n in ir.loads(e)] == [id(n) for n in walked if n.op is Op.LOAD]
            assert ir.variables(e) == {n.arg for n in walked if n.op is Op.VAR}
