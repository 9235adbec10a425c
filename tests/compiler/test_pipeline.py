"""compiler/pipeline.py: weld's passes named, in order, each timed and logged."""
import logging

import torch

import torchweld
from torchweld import timing
from torchweld.compiler.pipeline import ATEN_PASSES, FX_PASSES


def test_the_passes_are_listed_in_their_order():
    assert [p.name for p in FX_PASSES] == ["fuse_attention", "group_query_heads", "gated_matvec", "grouped_matvec",
                                           "empty_concatenations", "chain_concatenations", "fuse_conv_bn",
                                           "channels_last"]
    assert [name for name, _ in ATEN_PASSES] == ["common_subexpressions"]
    assert all(p.doc for p in FX_PASSES)


def test_each_pass_is_timed_and_logged_in_inference_and_training(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    timing.reset()
    compiled = torchweld.compile(model)
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"):
        with torch.no_grad():
            compiled(torch.randn(4, 8))
        compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()
    phases = torchweld.compile_times()
    for name in [p.name for p in FX_PASSES] + [name for name, _ in ATEN_PASSES]:
        assert f"weld.pass.{name}" in phases
    assert caplog.text.count("pass common_subexpressions:") == 2  # inference's aten graph, training's joint graph
