"""The performance-tuning constants of the weld backend, in one object, each with what it means.

    from torchweld.tuning import tuning
    if len(group.members) >= tuning.max_kernel_members: ...   # read when used, never copied at import
    with tuning.patch(row_block_elements=4096): ...           # a test, or an A/B of one constant

Each field is a number a measurement chose (the comments say which, or cite bench/DECISIONS.md):
changing one changes how fast weld's kernels compile or run, never what they compute.
`bench/with_constants.py row_block_elements=4096 -- SCRIPT ARGS` runs a script with fields
changed. Settings a user chooses are in config.py; facts that are not tuned (ALIGNMENT,
INT32_LIMIT) stay beside the code that needs them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass
class Tuning:
    # -- IR (compiler/ir.py) ----------------------------------------------------------------
    inline_max_nodes: int = 48  # a body larger than this is stored rather than recomputed by several readers
    small_read_fraction: int = 16  # a load from a buffer this many times smaller (a bias, a scale) is cheap
    # sin, exp... that a kernel over this many times their elements, and over costly_broadcast_min
    # elements, reads are stored rather than recomputed (ir.broadcasts_costly_math)
    costly_broadcast_ratio: int = 8
    costly_broadcast_min: int = 1 << 20

    # -- lowering (compiler/lowering.py) --------------------------------------------------
    # A reduction reading fewer elements runs in one step. Below ~8 MB of float32 (3 us of an
    # H100's bandwidth) the second launch costs more than it saves; densenet121's train step,
    # bound by CPU time, ran 400 launches more per step with 1 MB here. Rows read across (a
    # column sum) split from fewer: one step gives them a program per 8 to 64 outputs, so a
    # layer norm's or a bias's gradient over 768 features of 2048 rows ran 96 programs at
    # 0.75 TB/s. On the H100 this took 106 us of GPU time off GPT-2's step and 8 ms off
    # densenet121's (its batch norms' statistics over 1024 to 16384 rows); BERT's, over rows
    # of 1024, came out 61 us slower.
    split_min_elements: int = 1 << 21  # a reduction reading fewer elements than this runs in one step
    split_min_elements_across: int = 1 << 19  # the same for a reduction whose rows are read across
    partial_row_min: int = 128  # a two-step reduction's first step reduces rows at least this long
    # per-column sums take blocks of 64 columns a program, per-row sums blocks of 4 rows: ~512 programs
    partial_outputs_across: int = 64 * 512  # outputs a two-step reduction's first step aims at, rows read across
    partial_outputs: int = 4 * 512  # the same, rows read along

    # -- scheduling (compiler/schedule.py) ------------------------------------------------
    # Larger kernels (a training backward recomputing the residual stream of all 12 blocks of
    # GPT-2 in one kernel, 194 pointers) spill registers and take many seconds to compile. Kernels
    # of single elements (the step counters of all batch norms, of an optimizer's parameters) load
    # one buffer a member: Adam's 364 step counters of densenet121 in one kernel of 728 pointers
    # took 2.5 s to compile, the longest of its step; in kernels of 32, two distinct kernels (32
    # and the rest) of ~0.3 s each.
    max_kernel_members: int = 64  # buffers one kernel computes at most
    max_kernel_reads: int = 64  # buffers one kernel loads at most
    single_element_members: int = 32  # single-element buffers one kernel computes at most

    # -- C++ kernels (compiler/codegen/cpp_reduction.py, cpp.py) ----------------------------
    # cpp_reduction.py's docstring says why (chunks of 1024 were 12 times less accurate than
    # eager on a constant row; 256 costs no time).
    chunk: int = 256  # elements of a reduction's chunk: a float partial sum each, the chunks added in double
    segments: int = 64  # fixed segments a row shared by threads is cut into, combined in segment order
    threaded_min: int = 1 << 17  # a reduced row of this many elements or more is shared by threads...
    threaded_max_outputs: int = 8  # ...where the reduction has at most this many outputs
    # lanes of an outer reduction's simd loop: the columns one pass over the rows reduces. 16 (one
    # AVX-512 register of float) read half of each 128-byte row of a 32-channel channels-last
    # batch norm per pass, in twice the passes: the CNN's training step on the 2-core AMD EPYC
    # development host ran its C++ kernels in 4.8 ms a step at 16, 2.5 at 64, 3.8 at 128 (its
    # MLP's 1.63 -> 1.19, the transformer block's 3.73 -> 3.28; bench/investigations/
    # profile_train_cpu.py under bench/with_constants.py)
    outer_block: int = 64
    max_pieces: int = 16  # innermost loops a pointwise kernel is split into at most (a cat of 16 inputs)

    # -- Triton kernels (compiler/codegen/triton.py, triton_launches.py) --------------------
    max_persistent_rblock: int = 2048  # rows up to this long reduce in one block, longer ones loop
    # outputs side by side in a block of a reduction read across rows, at most. On the H100 a
    # column sum of 8192x3072 bfloat16 (GPT-2's MLP bias gradient) took 39 us a call at 64,
    # 29 at 32, 66 at 128; float32 43 / 40 / 67 (bench/DECISIONS.md#outer-xblock)
    outer_xblock: int = 32
    outer_programs: int = 128  # such a reduction's block shrinks (to 8) until it has this many programs
    looped_rblock: int = 1024  # the block of a looped reduction's row (RBLOCK)
    # One row of 768 (padded to 1024) a block, 8 elements a thread. On the H100 four rows a block
    # (4096) took GPT-2's training step 170 us longer in its generated kernels, BERT's 120 us;
    # inference was level (bench/DECISIONS.md#row-block).
    row_block_elements: int = 1024  # elements of a row-wise reduction's block, whole rows where they fit
    # With Triton's default 4 warps (8 elements a thread). On one H100 host, 2048-element blocks
    # with 8 warps took 3-7% longer on memory-bound kernels of 4M-64M floats (batch norm + add +
    # ReLU, an add/mul chain), on another as long, and 1-2% less on the 12-op transcendental chain
    # (bench/investigations/pointwise_launch.py; bench/DECISIONS.md#launch-xblock).
    pointwise_xblock: int = 1024  # elements of a pointwise kernel's block
    streaming: int = 1 << 22  # elements from which a pointwise kernel's data outgrows L2: loads evict first
    # Two compile twice either way, and with arguments each compile takes longer (densenet121
    # inference: 65 kernels, 37-40 s of worker CPU, against 67 and 31-34 s with literals) and the
    # GPU divides by magic number. densenet121's training step: forward 123 compiles, backward 165
    # (116 and 159 from the second member on, 261 and 240 with literals).
    literal_family_members: int = 2  # kernels of a family (size_args.py) that keep their integers as literals
    chunk_steps: int = 32  # RBLOCK-wide steps of a looped sum a chunk, each chunk's partial added in float64
    rand_nodes: int = 60  # a Philox draw's size in kernel nodes (ten unrolled rounds), for compile_order

    # -- runtime (torchweld/runtime/) -------------------------------------------------------
    block_s: int = 64  # cache positions a step of a decode_attention split reads (decode_attention.py)
    # Inference traces over symbolic sizes record scaled_dot_product_attention on CUDA as one
    # opaque op that calls it (runtime/opaque_attention.py) instead of its math path's matmuls
    # and softmax (BERT's mask). Off until timed on a GPU: its compile over symbols and its
    # steady state against the math path's.
    opaque_attention_over_symbols: bool = False
    # Each read is unrolled into the kernel (an int8 offset would hold 127): beyond it the pool
    # keeps aten's indices and aten's backward (pool_offsets.py).
    max_window: int = 16  # positions a max-pool window may have for weld's kernels
    # Training on the CPU keeps aten's max pool and its backward (int64 indices) rather than
    # weld's int8 argmax offsets: g++ 12 does not vectorize the C++ kernel that computes the
    # offsets beside the window maximum (its NaN test threaded through the ReLU's select is a
    # select of masks it cannot vectorize with AVX-512): 6.5 ms against 0.16 without the offsets
    # for (8, 32, 64, 64); the bench CNN's training step 22.1 -> 14.1 ms, eager 17.7 (2 cores).
    cpu_pool_offsets: bool = False
    max_layouts: int = 16  # distinct input layouts one CudaGraphed records before calling sizes dynamic
    max_workers: int = 16  # Triton compile workers at most, one per core, where config.compile_workers is None
    # A kernel a worker process compiled is only loaded in this process (Triton's cache hit, ~25 ms
    # of Python under the GIL each): a few threads do it, more only fight for the GIL. On the H100
    # host, densenet121's 68 kernels: 4.5 s of compile phase with 32 threads loading, 3.5-4.1 s
    # with 1 or 4 (resnet50's 19: 1.9 s either way).
    loading_threads: int = 4  # threads that load worker-compiled Triton kernels, where config.loading_threads is 0
    # Fewer compile in threads (or in the workers, once an earlier graph started them), which do as
    # well on small kernels: on the H100 host, resnet50's 19 took 2.1-2.5 s either way (a worker
    # starts in ~0.3 s), BERT's 8 1.6 s in threads and 2.3 s in workers started for them;
    # densenet121's 68 took 4.4-4.6 s in workers and 8.4 s in threads, and the 15 kernels of
    # densenet121's Adam step (long ones) 7.9 s in threads.
    workers_from: int = 12  # a graph's new Triton kernels from which worker processes compile them
    worker_timeout_s: int = 300  # past this a kernel's worker is given up on, and the kernel compiled here

    # -- training (torchweld/autograd/) -----------------------------------------------------
    # forward nodes a value's recomputation in the backward may reach back over (partition.py's
    # far_from_saved_values); torch.compile's partitioner bans fusible chains of about 100 too
    # (bench/DECISIONS.md#recompute-span)
    max_recompute_span: int = 100
    # the backward draws dropout's mask again from the seed the forward saved (8 bytes) rather
    # than read the mask the forward saved (a byte an element): bench/DECISIONS.md#dropout-seed
    redraw_dropout: bool = True

    # -- backends (torchweld/backends/) -----------------------------------------------------
    # Started at the first batch of workers_from kernels instead, the workers missed GPT-2's
    # training forward: its 8 kernels compiled in threads, under the GIL of the backward's
    # lowering, 3.4 s against 1.9-2.3 s in workers (H100 host). Inference graphs joined once
    # workers stopped hashing Triton's library at their first compile (triton_workers.install_key):
    # BERT's 7 kernels 0.87-0.95 s in workers, 1.06-1.19 in threads.
    workers_from_nodes: int = 100  # nodes of a CUDA graph from which weld starts the compile workers
    # 16 workers took ~2 s to be ready on the H100 host, and GPT-2's first kernels waited 0.4 s for
    # them when started at the backend. GPT-2's cold first call 2.12-2.37 s against 2.38-2.67;
    # resnet50's 2.91-3.28 against 2.97-2.98 (bench/with_constants.py workers_at_first_call=0 --
    # bench/investigations/profile_compile.py; bench/DECISIONS.md#workers-at-first-call).
    workers_at_first_call: bool = True  # a call with CUDA tensors starts the compile workers before its capture
    default_specializations: int = 16  # sizes weld compiles a graph with symbolic sizes for (weld_sizes.py)
    # the call of a new size at which weld compiles it (weld_sizes.py); the calls before run the graph
    # as captured: a generation loop whose length grows by one each call compiles nothing
    specialize_at_call: int = 2
    variants_limit: int = 8  # compiled variants for other module settings, then the graph runs as captured

    @contextlib.contextmanager
    def patch(self, **fields: int) -> Iterator[None]:
        """Temporarily set fields: `with tuning.patch(max_kernel_members=8): ...`."""
        known = [f.name for f in dataclasses.fields(self)]
        unknown = [name for name in fields if name not in known]
        if unknown:
            raise ValueError(f"tuning has no field {unknown[0]!r}; its fields: {', '.join(known)}")
        old = {name: getattr(self, name) for name in fields}
        for name, value in fields.items():
            setattr(self, name, value)
        try:
            yield
        finally:
            for name, value in old.items():
                setattr(self, name, value)


tuning = Tuning()
