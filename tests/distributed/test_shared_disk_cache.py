"""Ranks launched together compile the same kernels and graphs at the same moment into one disk
cache (torchweld/disk_cache.py writes each entry atomically): no rank sees a damaged entry and
none is left half-written. (Both ranks build each kernel; neither waits for the other.)"""
from __future__ import annotations

import logging
import os
import warnings

import torch
from ddp_training import Run, _train
from gloo_ranks import on_two_ranks, requires_gloo

import torchweld

pytestmark = requires_gloo


def compile_into(rank: int, cache_dir: str) -> dict:
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torchweld").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught, torchweld.config.patch(cache_dir=cache_dir,
                                                                                  graph_cache=True):
        warnings.simplefilter("always")
        outcome = _train(rank, Run(backend="weld", steps=1))
        torch.distributed.barrier()
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    return {"diffs": outcome.max_diff_per_step, "messages": messages}


def test_two_ranks_compile_into_one_disk_cache(tmp_path):
    cache = str(tmp_path / "cache")
    for outcome in on_two_ranks(compile_into, cache):
        assert max(outcome["diffs"]) <= 1e-5, outcome
        assert not [m for m in outcome["messages"] if "damaged" in m or "built again" in m], outcome["messages"]
    files = [os.path.join(d, f) for d, _, names in os.walk(cache) for f in names]
    assert any(f.endswith(".so") for f in files), files
    assert any(f.endswith(".json") for f in files), files  # the compiled graphs (graph_cache.py)
    assert not [f for f in files if f.endswith(".tmp")], files  # disk_cache's temporary files
