"""A compiled training graph kept whole in the graph cache (compiler/graph_cache.py).

The forward and backward of a training step are aten graphs the graph cache keeps like any
other; but finding their entries takes their text, and that takes the joint trace and the
partition, which a later process would redo (0.6-1.4 s of a GPT-2 or resnet50 step's warm
start on the H100 host). A training entry, named by the captured graph's own key (its nodes,
modules, tensors, inputs, options, process state and versions, as graph_cache.graph_key
makes it, with the partition strategy and grad mode beside), holds what the trace and the
partition decided: the two graphs' entries, what the forward saves for the backward, which
inputs it writes and which get gradients, how the outputs are put back together, and the
layouts the backward was compiled for. A process that finds it loads the forward at once and
the backward at the first backward, when its inputs have those layouts (else it traces again).

Written once the first backward has compiled, where both graphs' entries bind no module
attribute (they take the module's tensors as inputs: graph_cache.load_unbound). Sealed like
every entry: a damaged one is deleted with a warning, and the step compiled again.

A step compiled over symbolic sizes (backends/weld_symbolic.py) has an entry too, keyed by its
symbols as graph_cache keys any graph over them. Both its graphs are compiled at once, and
loaded so: the backward's entry, compiled last, holds every guard the step's compile recorded
(the trace's and the partition's among them), which the load checks at this call's sizes and
records for the compile's guard (where they do not hold, the step is traced again). It keeps
no layouts (a backward over symbols serves every call its guard admits) and names the sizes
the backward reads from the inputs (`numbers`).
"""
from __future__ import annotations

import json
import logging

import torch
import torch.utils._pytree as pytree

from torchweld import disk_cache, timing
from torchweld.compiler import graph_cache

log = logging.getLogger("torchweld.cache")

FORMAT = "torchweld-training-2"


def training_key(gm: torch.fx.GraphModule, example_inputs: list, options: dict, strategy: str) -> str | None:
    """The key of the training entry of `gm` (the captured graph), or None where it is not kept."""
    marked = {**options, "training partition": strategy, "grad enabled": torch.is_grad_enabled()}
    key = graph_cache.graph_key(gm, example_inputs, marked, traced=False, output_strides=None, frees_inputs=False)
    return None if key is None else key.key


def layouts(tensors: list) -> list:
    """Each tensor's shape, strides, dtype and device, and which of them share memory: what a
    backward compiled for one set of inputs assumes of another."""
    storages: dict[tuple, int] = {}
    described = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            described.append(None)
            continue
        group = storages.setdefault((str(t.device), t.untyped_storage().data_ptr()), len(storages))
        described.append([list(t.shape), list(t.stride()), str(t.dtype), str(t.device), group])
    return described


def store(key: str, forward_key: str, backward_key: str, backward_layouts: list | None, graph) -> None:
    """Write the training entry `key`: the two graphs' entries and what `graph` (an
    autograd.runtime.TrainingGraph) holds of the trace and the partition. `backward_layouts`:
    None over symbols."""
    entry = {
        "format": FORMAT, "forward": forward_key, "backward": backward_key, "backward_layouts": backward_layouts,
        "num_outputs": graph.num_outputs, "out_spec": pytree.treespec_dumps(graph.out_spec),
        "diff_outputs": graph.diff_outputs, "mutated_primals": graph.mutated_primals,
        "grad_primals": graph.grad_primals, "saved": [list(s) for s in graph.saved],
        "input_view_outputs": sorted(graph.input_view_outputs),
        "written_primal_views": _items(graph.written_primal_views), "primal_outputs": _items(graph.primal_outputs),
        "primal_views": _items(graph.primal_views), "enables_grad": graph.enables_grad,
        "numbers": [list(n) for n in graph.numbers],
    }
    try:
        disk_cache.write_sealed("graphs", f"t{key}.json", key, json.dumps(entry).encode())
        log.debug("graph cache: stored training entry %s", key)
    except (OSError, TypeError, ValueError) as e:
        log.debug("graph cache: training entry %s not written: %s", key, e)


def load(key: str) -> dict | None:
    """The training entry `key` as store wrote it (its dicts' keys ints again), or None."""
    data = disk_cache.read_sealed("graphs", f"t{key}.json", key)
    if data is None:
        return None
    with timing.phase("weld.graph_cache.load"):
        try:
            entry = json.loads(data)
            if entry.get("format") != FORMAT:
                raise ValueError(f"its format is {entry.get('format')!r}, not {FORMAT!r}")
            entry["out_spec"] = pytree.treespec_loads(entry["out_spec"])
            entry["saved"] = [tuple(s) for s in entry["saved"]]
            entry["numbers"] = [tuple(n) for n in entry["numbers"]]
            entry["input_view_outputs"] = frozenset(entry["input_view_outputs"])
            for name in ("written_primal_views", "primal_outputs", "primal_views"):
                entry[name] = {int(i): _tuple(v) for i, v in entry[name]}
        except Exception as e:  # noqa: BLE001 - an entry this torchweld cannot use: traced again
            log.warning("torchweld: the training graph cache entry t%s.json cannot be used (%s: %s); "
                        "compiling the step again", key, type(e).__name__, e)
            return None
    log.debug("graph cache: loaded training entry %s", key)
    return entry


def _items(mapping: dict) -> list:
    return [[i, v] for i, v in sorted(mapping.items())]


def _tuple(value):
    """JSON's lists back to the tuples TrainingGraph holds ((primal, size, stride, offset), or a primal)."""
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value
