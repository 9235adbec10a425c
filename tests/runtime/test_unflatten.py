"""runtime/unflatten.py: every structure a graph returns comes back as pytree builds it."""
import collections

import torch
import torch.utils._pytree as pytree

from torchweld.runtime.unflatten import unflattener

Pair = collections.namedtuple("Pair", "a b")


def test_every_structure_comes_back_as_pytree_builds_it():
    t = torch.ones(1)
    for value in (t, (t, t), [t, t, t], (), [], (t, None), (t, [t, t]), {"a": t, "b": (t,)}, Pair(t, t),
                  [(t,), t], (t,)):
        leaves, spec = pytree.tree_flatten(value)
        got, want = unflattener(spec)(list(leaves)), pytree.tree_unflatten(list(leaves), spec)
        assert type(got) is type(want) and repr(got) == repr(want)
