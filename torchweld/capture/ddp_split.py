"""Split a graph captured inside DistributedDataParallel's forward at DDP's gradient buckets,
and compile each piece with the backend on its own.

A compiled training graph is one autograd node: every gradient it makes comes out at the end
of its backward, so DDP's bucket all-reduces all start after it. Split in pieces, each
piece's backward is a node of its own: once the backward of the last piece has run, the
gradients of the parameters it used are complete, DDP's hooks mark their bucket ready, and
its all-reduce runs while the backward of the pieces before it goes on (torch.compile's
DDPOptimizer does the same).

The buckets are estimated as DDP's reducer makes them: parameters in the reverse of the
order they are used, a bucket closed once it holds at least its cap of bytes (the first
bucket's cap, then `bucket_bytes_cap`, or DDP's per-bucket list). The split changes no result,
only where the graph is cut; a graph inside no DDP forward is compiled whole.

Pieces are compiled at their first call, with the tensors that reach them then as example
inputs (the backend gets real tensors, as for a whole graph); the graph's guards make every
later call's tensors alike. A graph with symbolic sizes (dynamic shapes) is compiled whole:
pieces compiled from one call's tensors would hold its sizes."""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Callable

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from torchweld import config
from torchweld.capture.ddp import active_ddp_module
from torchweld.errors import BackendCompilerFailed

log = logging.getLogger(__name__)

META_KEY = "ddp_split"  # gm.meta[META_KEY]: the DDPSplit of a graph that was split (explain() shows it)


@dataclasses.dataclass(frozen=True)
class DDPSplit:
    """How a graph was split: its pieces in forward order, and the parameter bytes each holds."""

    piece_param_bytes: tuple[int, ...]
    first_bucket_cap: int
    bucket_cap: int

    @property
    def pieces(self) -> int:
        return len(self.piece_param_bytes)

    def __str__(self) -> str:
        held = ", ".join(f"{b} B" for b in self.piece_param_bytes)
        return (f"split into {self.pieces} pieces at DistributedDataParallel's gradient buckets (caps: first "
                f"bucket {self.first_bucket_cap} B, then {self.bucket_cap} B; parameters per piece: {held}), so "
                "that each bucket's all-reduce starts while the backward of the pieces before it runs")


def run_backend(compile_: Callable, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """`compile_(gm, example_inputs)` (a backend, or compile_graph below), checked to be callable,
    the grad mode as before it (a backend that traces or runs the graph executes its grad-mode
    nodes). For the whole graph (convert_frame) and for each piece of a split one (_LazyPiece)."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        compiled = compile_(gm, example_inputs)
    if not callable(compiled):
        raise TypeError(f"the backend returned {compiled!r}, which is not callable")
    return compiled


def compile_graph(backend: Callable, backend_name: str, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """`backend(gm, example_inputs)`, or, inside a DDP forward, the graph split at DDP's buckets."""
    ddp = active_ddp_module()
    if ddp is None or not config.optimize_ddp:
        return backend(gm, example_inputs)
    if has_symbolic_sizes(gm):  # pieces compiled from one call's tensors would be specialized to its sizes
        log.info("a graph with symbolic sizes is compiled whole, not split at DDP's buckets")
        return backend(gm, example_inputs)
    return split_at_buckets(gm, example_inputs, ddp, backend, backend_name)


def has_symbolic_sizes(gm: torch.fx.GraphModule) -> bool:
    """Whether any value of `gm` has a symbolic size, stride or value (dynamic shapes)."""
    for node in gm.graph.nodes:
        for value in torch.utils._pytree.tree_leaves(node.meta.get("example_value")):
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return True
            if isinstance(value, torch.Tensor):
                layout = (*value.stride(), value.storage_offset()) if value.layout == torch.strided else ()
                if not all(isinstance(n, int) for n in (*value.shape, *layout)):
                    return True
    return False


# -- the buckets ----------------------------------------------------------------------
def bucket_caps(ddp: torch.nn.Module) -> tuple[int, int, list[int]]:
    """(first bucket's cap, every later bucket's cap, per-bucket caps if the user gave them)."""
    cap = int(ddp.bucket_bytes_cap)
    config_ = getattr(ddp, "_bucket_config", None)  # torch >= 2.9; before, DDP's first bucket is 1 MiB
    first = int(config_.first_bucket_bytes_cap) if config_ is not None else \
        int(getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", cap))
    per_bucket = [int(b) for b in getattr(ddp, "bucket_bytes_cap_list", None) or []]
    return first, cap, per_bucket


def _synced_parameters(ddp: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """The parameters whose gradients DDP all-reduces, by id."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    return {id(p): p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored}


def _parameters_of(node: torch.fx.Node, gm: torch.fx.GraphModule, inputs: dict[torch.fx.Node, object],
                   synced: dict[int, torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The synced parameters `node` reads: as graph inputs, attributes, or inside a called module."""
    found = []
    if node.op == "call_module":
        found += list(gm.get_submodule(node.target).parameters())
    elif node.op == "get_attr":
        attr = gm
        for part in node.target.split("."):
            attr = getattr(attr, part)
        found += list(attr.parameters()) if isinstance(attr, torch.nn.Module) else [attr]  # a checkpointed block
    found += [inputs[arg] for arg in node.all_input_nodes if arg in inputs]
    return [p for p in found if isinstance(p, torch.Tensor) and id(p) in synced]


def assign_pieces(gm: torch.fx.GraphModule, example_inputs: list, ddp: torch.nn.Module) -> tuple[dict, list[int]]:
    """Each computing node's piece (0 first in forward order), and the parameter bytes of each
    piece. Walked backwards, as the backward runs: a node goes to the open bucket, which closes
    once its parameters reach its cap and a new one opens."""
    first_cap, cap, per_bucket = bucket_caps(ddp)
    synced = _synced_parameters(ddp)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = dict(zip(placeholders, example_inputs))
    bucket_of, sizes, seen = {}, [0], set()
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        index = len(sizes) - 1
        limit = per_bucket[min(index, len(per_bucket) - 1)] if per_bucket else (first_cap if index == 0 else cap)
        if sizes[-1] >= limit:
            sizes.append(0)
        for p in _parameters_of(node, gm, inputs, synced):
            if id(p) not in seen:
                seen.add(id(p))
                sizes[-1] += p.numel() * p.element_size()
        bucket_of[node] = len(sizes) - 1
    last = len(sizes) - 1
    return {node: last - bucket for node, bucket in bucket_of.items()}, list(reversed(sizes))


# -- splitting and compiling ---------------------------------------------------------------
def split_at_buckets(gm: torch.fx.GraphModule, example_inputs: list, ddp: torch.nn.Module,
                     backend: Callable, backend_name: str) -> Callable:
    piece_of, piece_bytes = assign_pieces(gm, example_inputs, ddp)
    # a piece with no parameters (the last nodes, after every parameter's use) joins the one before it
    while len(piece_bytes) > 1 and piece_bytes[-1] == 0:
        piece_bytes.pop()
        piece_of = {node: min(piece, len(piece_bytes) - 1) for node, piece in piece_of.items()}
    if len(piece_bytes) < 2:
        return backend(gm, example_inputs)
    first_cap, cap, _ = bucket_caps(ddp)
    try:
        split = _split(gm, piece_of, backend, backend_name)
    except Exception as e:  # a bug here costs overlap, not the user's run: the graph is compiled whole
        if config.raise_internal_errors:
            raise
        log.warning("torchweld: the graph was not split at DDP's buckets (%s: %s); compiled whole", type(e).__name__, e)
        return backend(gm, example_inputs)
    gm.meta[META_KEY] = DDPSplit(tuple(piece_bytes), first_cap, cap)
    log.info("graph split at DDP's buckets: %s", gm.meta[META_KEY])
    return split


def _split(gm: torch.fx.GraphModule, piece_of: dict, backend: Callable, backend_name: str) -> torch.fx.GraphModule:
    """`gm` as a graph calling one submodule per piece, each compiled at its first call."""
    split = split_module(gm, gm, lambda node: piece_of[node], keep_original_order=True)
    for node in list(split.graph.nodes):
        if node.op == "call_module" and node.target.startswith("submod_"):
            piece = getattr(split, node.target)
            _return_a_tuple(piece, node, split.graph)
            setattr(split, node.target, _LazyPiece(piece, backend, backend_name))
    split.recompile()
    return split


def _return_a_tuple(piece: torch.fx.GraphModule, call: torch.fx.Node, parent: torch.fx.Graph) -> None:
    """Make `piece` return a tuple (what backends are given), and its caller take item 0 where
    split_module made it return one value."""
    output = next(n for n in piece.graph.nodes if n.op == "output")
    (value,) = output.args
    if isinstance(value, (tuple, list)):
        return
    output.args = ((value,),)
    piece.recompile()
    with parent.inserting_after(call):
        item = parent.call_function(_first, (call,))
    call.replace_all_uses_with(item, delete_user_cb=lambda user: user is not item)


def _first(values: tuple):
    return values[0]


class _LazyPiece(torch.nn.Module):
    """One piece of a split graph: compiled by the backend at its first call."""

    def __init__(self, piece: torch.fx.GraphModule, backend: Callable, backend_name: str):
        super().__init__()
        self.piece = piece
        self.backend, self.backend_name = backend, backend_name
        self.compiled: Callable | None = None

    def forward(self, *args):
        if self.compiled is None:
            self.compiled = self._compile(list(args))
        return self.compiled(*args)

    def _compile(self, example_inputs: list) -> Callable:
        try:
            return run_backend(self.backend, self.piece, example_inputs)
        except Exception as e:
            if config.suppress_errors:
                warnings.warn(f"torchweld: backend {self.backend_name!r} failed on a piece of a graph split at DDP's "
                              f"buckets ({type(e).__name__}: {e}); running that piece as captured", stacklevel=2)
                return self.piece.forward
            raise BackendCompilerFailed(self.backend_name, e) from e
