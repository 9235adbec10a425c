"""The `cudagraphs` backend: the captured graph's own eager ops, recorded as CUDA
graphs and replayed (no code generation). Graphs that need autograd, hold CPU
tensors or synchronize with the host run eagerly; the log says why, once."""
from __future__ import annotations

import torch

from torchweld.backends import Option, register_backend


@register_backend("cudagraphs")
def cudagraphs(gm: torch.fx.GraphModule, example_inputs: list, mode=None, options=None):
    from torchweld.backends.weld import needs_autograd
    from torchweld.runtime.cudagraphs import (
        CudaGraphed, graph_reason, mutated_placeholders, pool_for, resident_placeholders,
    )

    options = {} if options is None else options
    pool = pool_for(options)
    name = pool.next_name("cudagraphs graph")
    if needs_autograd(gm, example_inputs):
        pool.log_fallback(name, "the graph needs autograd; the cudagraphs backend records inference only")
        return gm.forward
    return CudaGraphed(gm.forward, pool=pool, name=name, static_input_indices=resident_placeholders(gm),
                       mutated_input_indices=mutated_placeholders(gm),
                       outputs=options.get("cudagraph_outputs", "copy"),
                       graph_reason=graph_reason(gm, pool.recorder.device_type), guarded=True)


cudagraphs.known_options = {
    "cudagraph_outputs": Option("what a replay hands out: 'copy' (default) or 'track' (the recording's own buffers)",
                                choices=("copy", "track")),
    "cudagraph_pool": Option("a runtime.cudagraphs.CudaGraphPool to share between compiled models (default: one "
                             "per compiled model)", types=(object,)),
}
