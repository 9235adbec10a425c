"""The weld backend's passes, in the order they run, in one place.

    captured FX graph
      FX_PASSES        torch-level rewrites (attention, concatenations, conv/BN folding, layouts)
      to aten          compiler/aten_graph.py (inference) or autograd/joint.py (training: the
                       forward and its backward traced together, functionalized, saves made smaller)
      ATEN_PASSES      aten-level cleanups, the same for inference and training
      lower            compiler/lowering.py: each aten op to the loop IR, or an extern call
      schedule         compiler/schedule.py: fusion into kernels, buffer reuse, frees
      codegen          compiler/codegen/: C++ and Triton kernels and the Python wrapper
                       (compiler/driver.py runs lower, schedule and codegen)

Each pass here is named: its time is a `weld.pass.<name>` phase of `torchweld.compile_times()`,
and `TORCHWELD_LOGS=+weld` logs what each changed (nodes before and after).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from torchweld import timing

log = logging.getLogger("torchweld.weld")


@dataclasses.dataclass(frozen=True)
class FxPass:
    """A torch-level pass: `run(gm, options, inference)` returns the graph module to go on with."""

    name: str
    run: Callable[[torch.fx.GraphModule, dict, bool], torch.fx.GraphModule]
    doc: str


def _fuse_attention(gm, options, inference):
    from torchweld.passes.fuse_attention import fuse_attention

    return fuse_attention(gm) if options.get("fuse_attention", True) else gm


def _group_query_heads(gm, options, inference):
    from torchweld.passes.grouped_attention import group_query_heads

    return group_query_heads(gm, split_kernel=inference) if options.get("group_query_heads", True) else gm


# The two one-row product rewrites are off by default: built and tested, not yet timed on a GPU
# (the H200 micro-benchmark had gate and up as one weight 14.4 us against 2 x 7.9, and q/k/v as
# one 5.6 against 4.6 + 3.0 + 3.0, but not these kernels; bench/investigations/matvec.py times them).
def _fuse_gated_products(gm, options, inference):
    from torchweld.passes.decode_products import fuse_gated_products

    wanted = inference and options.get("cudagraphs") and options.get("gated_matvec", False)
    return fuse_gated_products(gm) if wanted else gm


def _group_shared_input_products(gm, options, inference):
    from torchweld.passes.decode_products import group_shared_input_products

    wanted = inference and options.get("cudagraphs") and options.get("grouped_matvec", False)
    return group_shared_input_products(gm) if wanted else gm


def _drop_empty_concatenations(gm, options, inference):
    from torchweld.compiler.cat_chains import drop_empty_concatenations

    if options.get("empty_concatenations", True):
        drop_empty_concatenations(gm)
    return gm


def _chain_concatenations(gm, options, inference):
    from torchweld.compiler.cat_chains import chain_concatenations

    if options.get("chain_concatenations", True):
        chain_concatenations(gm)
    return gm


def _fuse_conv_bn(gm, options, inference):
    from torchweld.passes.fuse_conv_bn import fuse_conv_bn

    return fuse_conv_bn(gm, live=True) if inference and options.get("freeze", False) else gm


def _channels_last(gm, options, inference):
    from torchweld.passes.channels_last import to_channels_last

    if not options.get("channels_last", True):
        return gm
    freeze = inference and options.get("freeze", False)
    return to_channels_last(gm, weights=freeze or not inference)


FX_PASSES: tuple[FxPass, ...] = (
    FxPass("fuse_attention", _fuse_attention,
           "softmax(q @ k^T * scale) @ v becomes one scaled_dot_product_attention call (in training too: "
           "the joint graph differentiates it into aten's fused backward); options={'fuse_attention': False}"),
    FxPass("group_query_heads", _group_query_heads,
           "decoding attention (one query position) over key/value heads repeated for grouped-query "
           "attention runs over the unrepeated heads, each query head a row (passes/grouped_attention.py), on "
           "CUDA in inference by a kernel split along the cache (runtime/decode_attention.py); "
           "options={'group_query_heads': False}"),
    FxPass("gated_matvec", _fuse_gated_products,
           "in inference under CUDA graphs, a SwiGLU gate of one row on CUDA in half precision, "
           "silu(linear(x, w_gate)) * linear(x, w_up), is one kernel (passes/decode_products.py); "
           "options={'gated_matvec': True} (off by default: not measured on a GPU yet)"),
    FxPass("grouped_matvec", _group_shared_input_products,
           "in inference under CUDA graphs, the one-row linear layers without bias that read one input on "
           "CUDA in half precision (transformers' q/k/v projections) are one kernel "
           "(passes/decode_products.py); options={'grouped_matvec': True} (off by default: not measured yet)"),
    FxPass("empty_concatenations", _drop_empty_concatenations,
           "a concatenation of one tensor and empty 1-d tensors (a transformers DynamicCache's first "
           "update) is that tensor, read in place where nothing can tell (compiler/cat_chains.py); "
           "options={'empty_concatenations': False}"),
    FxPass("chain_concatenations", _chain_concatenations,
           "a concatenation that extends an earlier one reads it instead of all its inputs again "
           "(compiler/cat_chains.py); options={'chain_concatenations': False}"),
    FxPass("fuse_conv_bn", _fuse_conv_bn,
           "with options={'freeze': True}, for inference, each batch norm folds into the convolution "
           "before it, its weights computed once (compiler/constant_folding.py)"),
    FxPass("channels_last", _channels_last,
           "convolutions in channels-last (CUDA, and the CPU's oneDNN ones); CUDA weights, and in training "
           "all, converted in the graph by weld's kernels; options={'channels_last': False}"),
)


def run_fx_passes(gm: torch.fx.GraphModule, options: dict, inference: bool) -> torch.fx.GraphModule:
    """`gm` through FX_PASSES, in order."""
    for fx_pass in FX_PASSES:
        before = len(gm.graph.nodes)
        with timing.phase(f"weld.pass.{fx_pass.name}"):
            gm = fx_pass.run(gm, options, inference)
        log.debug("pass %s: %d nodes -> %d", fx_pass.name, before, len(gm.graph.nodes))
    return gm


def _common_subexpressions(graph: torch.fx.Graph) -> None:
    from torchweld.compiler.cse import eliminate_common_subexpressions

    eliminate_common_subexpressions(graph)


# (name, pass over an aten graph in place)
ATEN_PASSES: tuple[tuple[str, Callable[[torch.fx.Graph], None]], ...] = (
    ("common_subexpressions", _common_subexpressions),
)


def run_aten_passes(graph: torch.fx.Graph) -> None:
    """An aten graph (inference's, or training's joint graph) through ATEN_PASSES, in order."""
    for name, aten_pass in ATEN_PASSES:
        before = len(graph.nodes)
        with timing.phase(f"weld.pass.{name}"):
            aten_pass(graph)
        log.debug("pass %s: %d nodes -> %d", name, before, len(graph.nodes))
