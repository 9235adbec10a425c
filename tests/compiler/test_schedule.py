"""Fusion decisions: how many kernels, what is stored, what is freed."""
import os

import pytest
import torch

from torchweld.compiler.schedule import ExternCall, Free
from weld_helpers import check


def chain(t):
    for _ in range(2):
        t = torch.sin(t) * 1.5 + 0.5
        t = torch.tanh(t) - torch.exp(-t.abs())
        t = torch.sigmoid(t) * t
    return t


def test_pointwise_chain_is_one_kernel():
    c = check(chain, [torch.randn(1000)])
    kernels = c.schedule.kernels()
    assert len(kernels) == 1
    assert kernels[0].writes == (c.schedule.graph.outputs[0].root,)
    assert not c.externs


def test_softmax_is_one_kernel_with_three_passes():
    c = check(lambda x: torch.softmax(x * 2, -1), [torch.randn(8, 32)])
    (kernel,) = c.schedule.kernels()
    assert kernel.is_reduction and len(kernel.stages) == 3
    assert len(kernel.writes) == 1  # only the output: max and sum stay in registers


def test_layer_norm_gelu_is_one_kernel():
    ln = torch.nn.LayerNorm(16)
    c = check(lambda x, w, b: torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (16,), w, b)),
              [torch.randn(4, 16), ln.weight.detach(), ln.bias.detach()])
    assert len(c.schedule.kernels()) == 1


def test_matmul_is_extern_and_bias_relu_fuse_after_it():
    w, b = torch.randn(8, 16), torch.randn(8)
    c = check(lambda x, w, b: torch.relu(torch.nn.functional.linear(x, w, b)), [torch.randn(4, 16), w, b])
    assert c.externs == ["aten.mm.default"]
    assert len(c.schedule.kernels()) == 1


def test_intermediate_read_by_two_kernels_is_stored_and_freed():
    def fn(x, z):
        y = x.exp() * z  # two loads: cheaper to store than to recompute in both readers
        return y.sum(0), y.t().contiguous().sum(0)

    c = check(fn, [torch.randn(6, 5), torch.randn(6, 5)])
    frees = [s for s in c.schedule.steps if isinstance(s, Free)]
    stored = {w for k in c.schedule.kernels() for w in k.writes}
    outputs = {v.root for v in c.schedule.graph.outputs}
    intermediates = stored - outputs
    assert intermediates  # y feeds two reduction kernels over different dims
    assert intermediates <= {n for f in frees for n in f.names}


def test_cheap_intermediate_read_by_two_kernels_is_recomputed_not_stored():
    def fn(x, bias):
        y = x + bias  # one large load: each reader loads x instead of y
        return y.sum(0), y.t().contiguous().sum(0), torch.nn.functional.gelu(y.view(4, 16, 32))

    c = check(fn, [torch.randn(64, 32), torch.randn(32)])
    stored = {w for k in c.schedule.kernels() for w in k.writes}
    assert stored == {v.root for v in c.schedule.graph.outputs}


def test_fused_qkv_bias_is_never_stored_whole():
    # GPT-2's attention: one projection with a bias, split into query, key and value; key and
    # value are appended to a cache (torch.cat) which leaves the graph; attention reads all three.
    # The projection is one addmm (attention reads the query where it lies); no kernel stores it.
    def attention(x, w, b, past_k, past_v):
        q, k, v = torch.addmm(b, x.view(-1, 32), w).view(2, 8, 96).split(32, dim=2)
        q, k, v = (t.view(2, 8, 4, 8).transpose(1, 2) for t in (q, k, v))
        k, v = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(2, 8, 32), k, v

    empty = torch.empty(2, 4, 0, 8)
    c = check(attention, [torch.randn(2, 8, 32), torch.randn(32, 96), torch.randn(96), empty, empty])
    graph = c.schedule.graph
    (mm,) = [n for n, b in graph.buffers.items() if "mm" in str(getattr(b, "target", ""))]
    stored = {w for k in c.schedule.kernels() for w in k.writes}
    assert all(c.schedule.layouts[w][1].numel < 16 * 96 for w in stored), "the biased projection was stored"
    readers_of_mm = [k for k in c.schedule.kernels() if mm in k.reads]
    assert len(readers_of_mm) == 1  # query, key and value copies are one kernel


def test_a_biased_projection_that_attention_reads_is_one_addmm():
    """GPT-2's query, key and value are views of `x @ w + b`: with the bias in aten.addmm
    (cuBLAS's epilogue on CUDA) attention reads them where they lie, no kernel copies them."""
    def attention(x, w, b):
        q, k, v = torch.addmm(b, x.view(-1, 32), w).view(2, 8, 96).split(32, dim=2)
        q, k, v = (t.view(2, 8, 4, 8).transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    c = check(attention, [torch.randn(2, 8, 32), torch.randn(32, 96), torch.randn(96)])
    assert "aten.addmm.default" in c.externs and "aten.mm.default" not in c.externs
    assert not c.schedule.kernels()


def test_a_product_read_without_its_bias_too_stays_one_matrix_product():
    """Where the graph reads x @ w itself as well as x @ w + b, the sum stays a kernel's: an
    addmm would compute the product a second time."""
    def fn(x, w, b):
        y = x @ w
        q = (y + b).view(2, 8, 4, 8).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q), y.sum()

    c = check(fn, [torch.randn(16, 32), torch.randn(32, 32), torch.randn(32)])
    assert c.externs.count("aten.mm.default") == 1 and "aten.addmm.default" not in c.externs

    def both(x, w, b):
        y = x @ w
        return y + b, y

    c = check(both, [torch.randn(16, 32), torch.randn(32, 32), torch.randn(32)])
    assert c.externs == ["aten.mm.default"]


def test_a_biased_projection_that_only_kernels_read_keeps_its_bias_in_them():
    def mlp(x, w, b):
        return torch.nn.functional.gelu(torch.addmm(b, x, w)) @ w.t()

    c = check(mlp, [torch.randn(16, 32), torch.randn(32, 64), torch.randn(64)])
    assert c.externs.count("aten.mm.default") == 2 and "aten.addmm.default" not in c.externs


def test_buffers_are_reused():
    def fn(x, w):
        a = torch.relu(x) @ w  # relu's result is stored for the matmul and dies after it...
        return torch.sigmoid(a) @ w  # ...and sigmoid's, of its size, takes over its memory

    c = check(fn, [torch.randn(64, 48), torch.randn(48, 48)])
    assert c.kernel_sources and "# reuse" in c.wrapper_source


def _held_until_return(wrapper_source: str) -> set[str]:
    """Buffers the wrapper allocates that are neither returned nor deleted (nor handed on
    to a later buffer): they would hold their memory until the call returns."""
    import re

    body = wrapper_source[wrapper_source.rindex("\ndef call("):]
    allocated = set(re.findall(r"(buf\d+) = (?:torch.empty_strided|_take)\(", body))
    handed_on = set(re.findall(r"del (buf\d+)", body))
    returned = set(re.findall(r"buf\d+", body[body.rindex("return"):]))
    return allocated - handed_on - returned


def test_dead_buffers_not_taken_over_are_deleted_where_they_die():
    def fn(x, w):
        h = torch.relu(x * 2) @ w  # relu's result is stored for the extern, then dies
        return (h.exp().sum(1, keepdim=True) + h).sum(0)  # no later buffer has its size

    c = check(fn, [torch.randn(64, 48), torch.randn(48, 32)])
    assert c.externs and not _held_until_return(c.wrapper_source)
    c = check(lambda x: (x.exp().sum(1, keepdim=True) + x).sum(0) + (x.sin().sum(1, keepdim=True) + x).sum(0),
              [torch.randn(64, 64)])
    assert not _held_until_return(c.wrapper_source)



def _cpu_block(x, w):
    h = torch.relu(x @ w) * 2
    t = (h.exp().sum(1, keepdim=True) + h).softmax(1)  # stored for a matmul, then dead
    u = torch.tanh(t @ w.t())  # the same
    return (u @ w + x).sum(1), h.sum(0)


def test_cpu_intermediates_wait_in_the_workspace_for_the_next_call():
    """A CPU graph keeps its intermediates between calls (torch does not cache CPU memory, and
    fresh pages fault in on every call); what it returns is never one of them."""
    x, w = torch.randn(64, 48), torch.randn(48, 48)
    c = check(_cpu_block, [x, w])
    namespace = c.fn.__globals__
    workspaces = {k: v for k, v in namespace.items() if k.startswith("_workspace_")}
    assert workspaces and all(len(v) == 1 for v in workspaces.values())
    kept = {v[0].data_ptr() for v in workspaces.values()}
    first = c(x, w)
    first_copy = [t.clone() for t in first]
    assert not kept & {t.data_ptr() for t in first}
    assert {v[0].data_ptr() for v in workspaces.values()} == kept  # the same memory, taken and given back
    second_inputs = [torch.randn(64, 48), torch.randn(48, 48)]
    check(_cpu_block, second_inputs, compiled=c)
    for a, b in zip(first, first_copy):
        torch.testing.assert_close(a, b)  # the first call's outputs did not change under the second


def test_cpu_workspace_under_concurrent_calls():
    """Threads calling one compiled graph at once each get buffers of their own."""
    import threading

    x, w = torch.randn(64, 48), torch.randn(48, 48)
    c = check(_cpu_block, [x, w])
    inputs = [[torch.randn(64, 48), torch.randn(48, 48)] for _ in range(4)]
    expected = [_cpu_block(*args) for args in inputs]
    failures = []

    def run(args, want):
        for _ in range(20):
            got = c(*args)
            if not all(torch.allclose(g, e, atol=1e-5, rtol=1e-5) for g, e in zip(got, want)):
                failures.append(args)

    threads = [threading.Thread(target=run, args=(a, e)) for a, e in zip(inputs, expected)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_a_stored_value_and_a_reader_of_its_reshaped_view_are_one_kernel():
    """h over (B*T, C) is stored (a training forward saves it), and gelu reads it as (B, T, C).
    Both are one kernel, which stores h and gelu(h), at the same positions, with no division
    in their indices."""
    def fn(x, w, b):
        h = (torch.addmm(b, x.view(-1, 32), w) * 2).view(4, 8, 64)
        return h, torch.nn.functional.gelu(h, approximate="tanh"), h.view(2, 16, 64).sin()

    c = check(fn, [torch.randn(4, 8, 32), torch.randn(32, 64), torch.randn(64)])
    (kernel,) = c.schedule.kernels()
    assert len(kernel.writes) == 3
    assert "/" not in c.kernel_sources["cpp"].split("kernel0")[1] and "%" not in c.kernel_sources["cpp"].split("kernel0")[1]


def test_a_stored_biased_projection_is_one_addmm():
    """GPT-2's MLP in training: h = x @ w + b is saved for the backward and read by gelu as
    (B, T, C). aten.addmm writes h (the bias in its epilogue); one kernel computes gelu(h)."""
    def fn(x, w, b):
        h = torch.addmm(b, x.view(-1, 32), w).view(4, 8, 64)
        return h, torch.nn.functional.gelu(h, approximate="tanh"), h.view(2, 16, 64).sin()

    c = check(fn, [torch.randn(4, 8, 32), torch.randn(32, 64), torch.randn(64)])
    assert c.externs == ["aten.addmm.default"]
    (kernel,) = c.schedule.kernels()
    assert len(kernel.writes) == 2


def test_a_stored_projection_with_a_computed_bias_is_one_addmm():
    """Under autocast the bias is a bfloat16 copy of the float32 parameter, computed in the
    graph: it is stored by a small kernel and aten.addmm adds it in its epilogue, as eager's
    addmm does, instead of a kernel reading and writing the whole product again (GPT-2's MLP
    and attention projections in a bfloat16 autocast training step). The bias's kernel comes
    before the call."""
    def fn(x, w, b):
        h = torch.addmm(b * 2, x.view(-1, 32), w).view(4, 8, 64)
        return h, torch.nn.functional.gelu(h, approximate="tanh")

    c = check(fn, [torch.randn(4, 8, 32), torch.randn(32, 64), torch.randn(64)])
    assert c.externs == ["aten.addmm.default"]
    assert sorted(c.schedule.layouts[w][1].numel for k in c.schedule.kernels() for w in k.writes) == [64, 4 * 8 * 64]

    def projection(x, w, b):  # what autocast makes of F.linear(x, w, b)
        bf16 = torch.bfloat16
        h = torch.addmm(b.to(bf16), x.view(-1, 32).to(bf16), w.to(bf16).t())
        return h, torch.nn.functional.gelu(h.float())

    # bfloat16 sums of 32 products of about +-16: a few units of the last place apart (a
    # transposed or copied weight takes another CPU kernel)
    c = check(projection, [torch.randn(4, 8, 32), torch.randn(64, 32), torch.randn(64)], atol=0.25, rtol=0.02)
    assert "aten.addmm.default" in c.externs and "aten.mm.default" not in c.externs
    steps = [type(s).__name__ for s in c.schedule.steps if type(s).__name__ in ("Kernel", "ExternCall")]
    assert steps.index("ExternCall") == 3  # after the bias's, the activations' and the weight's casts


# Triton kernels on CPU tensors run in Triton's interpreter, which conftest turns on only
# where there is no CUDA (on a GPU host these run through test_triton's CUDA cases instead)
TRITON_ON_CPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@pytest.mark.parametrize("options", [None, pytest.param({"cpu_codegen": "triton"}, marks=TRITON_ON_CPU)])
def test_a_norm_read_as_rows_in_another_dtype_is_one_kernel_with_its_statistics(options):
    """GPT-2 under autocast: the layer norm's output over (B, T, C), cast to bfloat16 as
    (B*T, C) for the projection, was a kernel of its own reading the residual stream and
    the statistics again; it is a member of the norm's kernel, over the rows' loop."""
    def fn(x, r, g, b, w, bias):
        h = x + r
        y = torch.nn.functional.layer_norm(h, (32,), g, b)
        bf16 = torch.bfloat16
        return h, torch.addmm(bias.to(bf16), y.view(-1, 32).to(bf16), w.to(bf16))

    inputs = [torch.randn(4, 8, 32), torch.randn(4, 8, 32), torch.randn(32), torch.randn(32),
              torch.randn(32, 16), torch.randn(16)]
    # C++ kernels round to bfloat16 as eager; Triton's CPU interpreter truncates (a unit of the
    # last place on half the elements, summed over 32 products)
    atol, rtol = (0, 0) if options is None else (0.5, 0.05)
    c = check(fn, inputs, options=options, atol=atol, rtol=rtol)
    (norm,) = [k for k in c.schedule.kernels() if k.reduced]
    assert len(norm.writes) == 2  # h and the normalized rows; the statistics stay in registers
    assert len(c.schedule.kernels()) == 3  # and the weight's and the bias's casts


def test_a_buffer_lives_as_long_as_an_extern_view_of_it():
    """`as_strided` with strides no IR view takes runs as an aten call that returns a view.
    Its base was freed after that call, and the zeros made next took over its memory:
    the returned view read zeros (a compiled CNN's backward computed a zero gradient)."""
    def fn(x):
        v = torch.as_strided(x.relu() + 1, (2, 8, 1, 1), (8, 1, 8, 8))
        return v, torch.zeros(16) + x.sum()

    c = check(fn, [torch.randn(2, 8, 1, 1)])
    assert c.externs and "# reuse" not in c.wrapper_source


def test_kernels_stop_growing_at_the_size_cap():
    """A chain of 80 residual adds whose 80 layer-norm-like consumers could all join the first
    kernel (a GPT-2 backward recomputing every block's residual stream) is cut into kernels
    of at most tuning.max_kernel_members buffers and tuning.max_kernel_reads loads; results equal eager's."""
    from torchweld.tuning import tuning

    n = 80

    def fn(h, branches):
        outs = []
        for i in range(n):
            h = h + branches[i]
            outs.append(torch.tanh(h) * 2)
        return outs

    c = check(fn, [torch.randn(4, 8), torch.randn(n, 4, 8)])
    kernels = c.schedule.kernels()
    assert len(kernels) >= 2
    assert all(len(k.members) <= tuning.max_kernel_members for k in kernels)
    assert all(len(k.reads) <= tuning.max_kernel_reads for k in kernels)


def test_single_element_updates_are_cut_into_kernels_of_equal_size():
    """An optimizer's step counters (one element each) fuse across parameters, but into
    kernels of tuning.single_element_members at most: one kernel of all 364 of densenet121's took
    2.5 s to compile; equal ones compile once."""
    from torchweld.tuning import tuning

    n = 2 * tuning.single_element_members + 3

    graph = torch.fx.Graph()
    graph.output([graph.call_function(torch.add, (graph.placeholder(f"step{i}"), 1)) for i in range(n)])
    c = check(torch.fx.GraphModule(torch.nn.Module(), graph), [torch.tensor(float(i)) for i in range(n)])
    sizes = sorted(len(k.writes) for k in c.schedule.kernels())
    assert sizes == [3, tuning.single_element_members, tuning.single_element_members]


def test_mutated_inputs_are_written_in_place_where_nothing_reads_them_later():
    from weld_helpers import weld_compile

    def update(x, y):
        x.mul_(0.5).add_(y)  # loaded and stored at the same index: stored over x itself
        y.add_(y.t().contiguous())  # y read transposed too: a new buffer, copied back at the end
        return x * 2

    inputs = [torch.randn(8, 8) for _ in range(2)]
    expected_inputs = [t.clone() for t in inputs]
    compiled = weld_compile(update, [t.clone() for t in inputs])
    names = compiled.schedule.graph.input_names
    assert list(compiled.schedule.in_place.values()) == [names[0]]
    assert not set(compiled.schedule.in_place) & set(compiled.schedule.allocated)  # not allocated either
    expected = update(*expected_inputs)
    torch.testing.assert_close(compiled(*inputs), expected)
    for a, b in zip(inputs, expected_inputs):
        torch.testing.assert_close(a, b)


def test_a_cache_updated_by_index_copy_is_updated_in_place():
    """A KV cache's `cache.index_copy_(2, pos, k)`: functionalized into an out-of-place
    index_copy (a copy of the whole cache) written back at the end; weld calls index_copy_ on
    the input itself instead, and copies nothing back."""
    from weld_helpers import weld_compile

    def step(cache, pos, k):
        cache.index_copy_(2, pos, k)
        return (cache * 2).sum(2)

    def inputs(p):
        return [torch.zeros(2, 3, 8, 4), torch.tensor([p]), torch.randn(2, 3, 1, 4)]

    compiled = weld_compile(step, inputs(0))
    assert list(compiled.schedule.in_place.values()) == [compiled.schedule.graph.input_names[0]]
    body = compiled.wrapper_source.split("def call", 1)[1]
    copies = [line for line in body.splitlines() if "copy_(" in line]
    assert all("data_ptr() !=" in line for line in copies), copies  # only a restrided input's copy-back
    for p in (3, 0, 7, 3):
        got, expected = inputs(p), inputs(p)
        got[0].normal_(generator=torch.Generator().manual_seed(p))
        expected[0].copy_(got[0])
        expected[2].copy_(got[2])
        torch.testing.assert_close(compiled(*got), step(*expected))
        torch.testing.assert_close(got[0], expected[0])


def test_an_input_read_after_its_index_copy_is_not_updated_in_place():
    """The old value read after the write (the pointwise `old * 2` fused into the kernel after
    it): the update goes to a new buffer, copied back at the end."""
    from weld_helpers import weld_compile

    def step(cache, pos, k):
        old = cache * 2
        new = cache.index_copy(0, pos, k)
        cache.copy_(new)
        return old + new

    def inputs():
        return [torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 4]),
                torch.ones(2, 4)]

    compiled = weld_compile(step, inputs())
    got, expected = inputs(), inputs()
    torch.testing.assert_close(compiled(*got), step(*expected))
    torch.testing.assert_close(got[0], expected[0])


def test_an_index_copy_whose_source_is_a_view_of_the_cache_is_not_made_in_place():
    from weld_helpers import weld_compile

    def step(cache, pos):
        cache.index_copy_(0, pos, cache[:2].flip(0))
        return cache + 1

    def inputs():
        return [torch.arange(24.0).view(6, 4), torch.tensor([1, 0])]

    compiled = weld_compile(step, inputs())
    got, expected = inputs(), inputs()
    torch.testing.assert_close(compiled(*got), step(*expected))
    torch.testing.assert_close(got[0], expected[0])


def test_output_is_stored_over_the_buffer_its_kernel_reads_last():
    """As inductor's in-place reuse: a matmul's result, read for the last time by the
    kernel after it at the offsets it stores, gives that kernel's output its memory."""
    a, b = torch.randn(16, 8), torch.randn(8, 16)
    c = check(lambda a, b: (torch.mm(a, b) * 2).relu() + 1, [a, b])
    (mm,) = [s.name for s in c.schedule.steps if isinstance(s, ExternCall)]
    assert list(c.schedule.stored_over.values()) == [mm]
    assert "torch.empty" not in c.wrapper_source.split("def call", 1)[1]  # nothing newly allocated


def test_nothing_is_stored_over_a_buffer_read_elsewhere_than_where_the_output_goes():
    def transposed(a, b):
        t = torch.mm(a, b)
        return t * t.t()  # t[j, i] would be read after out[j, i] overwrote it

    def two_outputs(a, b):
        t = torch.mm(a, b)
        return [t.sin(), t.cos() * 3]  # one C++ kernel: its __restrict__ pointers rule out either

    def read_later(a, b):
        t = torch.mm(a, b)
        return ((t * 2).relu() @ b) + t  # t is not dying in the first kernel

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    assert not check(transposed, [a, b]).schedule.stored_over
    assert not check(two_outputs, [a, b]).schedule.stored_over
    later = check(read_later, [a, b]).schedule
    first, last = later.kernels()
    assert not set(first.writes) & set(later.stored_over)
    assert set(last.writes) == set(later.stored_over)  # where t and the second matmul die


_probe_saw_alive: list[bool] = []
_probe_watched = None  # a weakref.ref to the input the probe asks about


@torch.library.custom_op("torchweld_test::alive_probe", mutates_args=())
def alive_probe(x: torch.Tensor) -> torch.Tensor:
    """An extern call (an op weld has no lowering for) that records whether the watched input still lives."""
    if _probe_watched is not None:
        _probe_saw_alive.append(_probe_watched() is not None)
    return x.clone()


@alive_probe.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_graph_that_frees_inputs_lets_each_go_after_its_last_reader():
    """A backward's saved activations: compiled with frees_inputs and called through
    call_boxed, the graph empties the list it is handed and drops each input after the
    kernel that reads it last, so one the caller no longer holds is freed mid-call."""
    import weakref

    from torchweld.compiler import compile_graph
    from torchweld.compiler.aten_graph import to_aten_graph

    global _probe_watched

    def fn(a, b, unused):
        return [torch.ops.torchweld_test.alive_probe(b + a.sin()) * 2]

    def make():
        return [torch.randn(64), torch.randn(64), torch.randn(3)]

    for frees in (False, True):
        torch.manual_seed(0)
        inputs = make()
        expected = fn(*inputs)
        aten = to_aten_graph(torch.fx.symbolic_trace(fn), inputs).gm
        compiled = compile_graph(aten, inputs, traced=True, frees_inputs=frees)
        assert any(isinstance(s, ExternCall) for s in compiled.schedule.steps)
        watched, unused = weakref.ref(inputs[0]), weakref.ref(inputs[2])
        _probe_watched = watched
        _probe_saw_alive.clear()
        torch.testing.assert_close(compiled.call_boxed(inputs)[0], expected[0])
        _probe_watched = None
        assert inputs == []
        assert _probe_saw_alive == [not frees]  # freed by the probe's time only when the graph frees inputs
        assert watched() is None and unused() is None
        torch.manual_seed(0)
        again = make()
        torch.testing.assert_close(compiled(*again)[0], expected[0])  # a plain call leaves the caller's inputs be
        assert len(again) == 3


def test_rotary_embedding_stack_is_one_kernel():
    """The rotated halves of a pair, stacked and flattened (gpt-fast's and Llama's real-valued
    rotary embedding): one kernel, no copies by aten.stack."""
    def rotary(x, table):
        pairs = x.float().reshape(1, 3, 4, 4, 2)
        out = torch.stack([pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1],
                           pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1]], -1)
        return out.flatten(3).type_as(x)

    c = check(rotary, [torch.randn(1, 3, 4, 8), torch.randn(1, 3, 1, 4, 2)])
    assert not any(isinstance(s, ExternCall) for s in c.schedule.steps)
    assert len(list(c.schedule.kernels())) == 1
    check(lambda a, b, c: torch.stack([a, b, c], 1) * 2, [torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)])


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(q, k, inv_freq):
    """Llama's rotary embedding as transformers computes it: the cosine and sine of a (length,
    head dim) table, broadcast over the batch and the heads."""
    t = torch.arange(q.shape[2], dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _costly_calls_per_element(kernel) -> int:
    from torchweld.compiler.ir import Op, walk
    stores = list(kernel.outer_stores) + [s for stage in kernel.stages for s in stage.stores]
    return sum(1 for s in stores for e in walk(s.value) if e.op in (Op.SIN, Op.COS))


@pytest.mark.parametrize("codegen", ["cpp", pytest.param("triton", marks=TRITON_ON_CPU)])
def test_a_broadcast_table_of_sines_is_computed_once_not_per_reader_element(codegen):
    from torchweld.tuning import tuning

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    args = [torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8), inv_freq]
    with tuning.patch(costly_broadcast_min=1):  # (the default waits for a million elements a reader)
        c = check(_rotary, args, options={"cpu_codegen": codegen})
    kernels = list(c.schedule.kernels())
    table = [k for k in kernels if _costly_calls_per_element(k)]
    assert len(kernels) == 2 and len(table) == 1 and table[0].outer == (16, 8)
    # small readers recompute the table: a kernel of its own would cost more than it saves
    small = check(_rotary, args, options={"cpu_codegen": codegen})
    assert len(list(small.schedule.kernels())) == 1
