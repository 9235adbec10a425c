"""Joint graphs and their partition, called directly on small graphs."""
import pytest
import torch
import torch.nn as nn

from torchweld.autograd import module_state, partition, trace_joint
from torchweld.compiler.op_effects import is_random, is_view
from torchweld.runtime.seeded_rand import seeded_rand
from torchweld.tuning import tuning


def joint_of(fn, *inputs):
    gm = torch.fx.symbolic_trace(fn)
    state = module_state(gm)
    return trace_joint(gm, state, [s.read(gm) for s in state] + list(inputs))


def run_partition(part, joint, primals, tangents):
    """Forward then backward, as CompiledGraphFunction runs them, with the aten graphs themselves."""
    res = list(part.forward(*primals))
    k, m = joint.num_outputs, len(joint.mutated_primals)
    outs, intermediates = res[:k], res[k + m:]
    saved = [primals[i] if kind == "primal" else intermediates[i] for kind, i in part.saved]
    return outs, list(part.backward(*saved, *tangents))


def assert_partition_matches_autograd(part, joint, fn, primals, tangent, wrt=None):
    """The forward's output and the backward's gradients equal eager's and autograd's for
    `fn(*primals)` (gradients with respect to `wrt`, the primals by default)."""
    outs, grads = run_partition(part, joint, primals, [tangent])
    expected = fn(*primals)
    torch.testing.assert_close(outs[0], expected)
    wanted = torch.autograd.grad(expected, wrt or primals, tangent)
    assert len(grads) == len(wanted)
    for got, want in zip(grads, wanted):
        torch.testing.assert_close(got, want)


def pointwise_chain(x, w):
    y = torch.sin(x * w)
    z = torch.cos(y) * torch.tanh(y) + y.exp()
    return (z * z).sum(dim=1)


@pytest.mark.parametrize("strategy", ["save_all", "min_cut"])
def test_partition_matches_autograd(strategy):
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    joint = joint_of(pointwise_chain, x, w)
    part = partition(joint, strategy)
    tangent = torch.randn(6)
    outs, grads = run_partition(part, joint, [x, w], [tangent])
    expected = pointwise_chain(x, w)
    gx, gw = torch.autograd.grad(expected, [x, w], tangent)
    torch.testing.assert_close(outs[0], expected)
    torch.testing.assert_close(grads[0], gx)
    torch.testing.assert_close(grads[1], gw)


def test_min_cut_saves_fewer_bytes_than_save_all():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    joint = joint_of(pointwise_chain, x, w)
    save_all, min_cut = partition(joint, "save_all"), partition(joint, "min_cut")
    assert min_cut.saved_bytes < save_all.saved_bytes
    # Here everything the backward needs is recomputable from the inputs themselves.
    assert min_cut.saved_bytes == 0 and all(kind == "primal" for kind, _ in min_cut.saved)


def test_matmul_is_saved_not_recomputed():
    x = torch.randn(4, 8, requires_grad=True)
    joint = joint_of(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), x)
    part = partition(joint, "min_cut")
    bw_ops = {str(n.target) for n in part.backward.graph.nodes if n.op == "call_function"}
    fw_mm = sum(1 for n in part.forward.graph.nodes if "mm" in str(n.target))
    bw_mm = sum(1 for n in part.backward.graph.nodes if "mm" in str(n.target))
    assert fw_mm == 1 and bw_mm == 2, bw_ops  # the forward matmul is not run again


def test_random_ops_run_once_in_the_forward():
    def fn(x):
        return torch.nn.functional.dropout(x.sin(), 0.5, training=True).cos()

    x = torch.randn(16, 16, requires_grad=True)
    joint = joint_of(fn, x)
    part = partition(joint, "min_cut")
    assert any(is_random(n) for n in part.forward.graph.nodes)
    assert not any(is_random(n) for n in part.backward.graph.nodes)
    # the backward draws the mask again from the seed the forward drew it with
    seeds = [n for n in part.backward.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.int64]
    assert [u.target for s in seeds for u in s.users] == [seeded_rand]


def test_buffer_update_is_an_output():
    model = nn.Sequential(nn.BatchNorm1d(4))
    x = torch.randn(8, 4, requires_grad=True)
    joint = joint_of(model, x)
    names = [s.name for s in module_state(torch.fx.symbolic_trace(model))]
    mutated = {names[i] for i in joint.mutated_primals}
    assert mutated == {"0.running_mean", "0.running_var", "0.num_batches_tracked"}


class _DenseLayers(nn.Module):
    """Three DenseNet layers: batch norm, ReLU and a 1x1 convolution over all earlier features."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList([nn.BatchNorm2d(4 + 4 * i) for i in range(3)])
        self.convs = nn.ModuleList([nn.Conv2d(4 + 4 * i, 4, 1) for i in range(3)])

    def forward(self, x):
        features = [x]
        for norm, conv in zip(self.norms, self.convs):
            features.append(conv(torch.relu(norm(torch.cat(features, 1)))))
        return torch.cat(features, 1)


def test_recomputed_ops_run_just_before_the_backward_op_that_needs_them():
    model = _DenseLayers()
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    joint = joint_of(model, x)
    part = partition(joint, "min_cut")
    nodes = list(part.backward.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    on_tangents, stack = set(), list(placeholders[len(part.saved):])
    while stack:
        n = stack.pop()
        if n not in on_tangents:
            on_tangents.add(n)
            stack.extend(n.users)
    position = {n: i for i, n in enumerate(nodes)}
    recomputed = [n for n in nodes if n.op == "call_function" and n not in on_tangents]
    assert recomputed  # relu(norm(cat)) is recomputed, not saved
    for n in recomputed:
        first_user = min(n.users, key=position.__getitem__)
        between = nodes[position[n] + 1:position[first_user]]
        assert not any(b in on_tangents for b in between), f"{n.name} runs long before {first_user.name}"


def residual_stream(h, w1, w2, w3, w4):
    for w in (w1, w2, w3, w4):
        h = h + torch.nn.functional.layer_norm(h, (16,)) @ w
    return h


def test_residual_stream_is_saved_and_parameter_inputs_cost_nothing():
    """GPT-2's blocks: h = h + f(layer_norm(h)), with f's weights reaching the graph as inputs
    (transformers' Conv1D). Saving each h or each f output costs as many bytes; the later
    values win the tie, else the backward would recompute the whole stream at its start.
    Parameters cost nothing to save (they stay in memory), plain inputs their bytes."""
    h = torch.randn(8, 16, requires_grad=True)
    weights = [nn.Parameter(torch.randn(16, 16) / 4) for _ in range(4)]
    joint = joint_of(residual_stream, h, *weights)
    part = partition(joint, "min_cut")
    saved = [n for n in joint.gm.graph.nodes if n.name in part.saved_nodes]
    assert not any("mm" in str(n.target) for n in saved), [str(n.target) for n in saved]
    plain = joint_of(residual_stream, h, *[w.detach().clone().requires_grad_() for w in weights])
    assert part.saved_bytes <= partition(plain, "min_cut").saved_bytes
    assert_partition_matches_autograd(part, joint, residual_stream, [h, *weights], torch.randn(8, 16))


def half_branch_stream(h, w1, w2, w3, w4, w5, w6, w7, w8):
    """A residual stream under autocast: each branch output is bfloat16, half the float32 h's bytes."""
    for w in (w1, w2, w3, w4, w5, w6, w7, w8):
        h = h + (h.sin() @ w).to(torch.bfloat16).float()
    return h


def test_a_long_recomputation_chain_is_not_recomputed():
    """Saving the bfloat16 branch outputs is fewer bytes, but the backward would recompute
    the whole float32 stream at its start: past tuning.max_recompute_span forward nodes
    the stream is computed in the forward and saved (partition.far_from_saved_values)."""
    from torchweld.tuning import tuning

    h = torch.randn(8, 16, requires_grad=True)
    weights = [torch.randn(16, 16, requires_grad=True) for _ in range(8)]
    joint = joint_of(half_branch_stream, h, *weights)
    stream = [n.name for n in joint.gm.graph.nodes if n.target is torch.ops.aten.add.Tensor][:8]  # the forward's

    def recomputed(part) -> int:
        return sum(n.op == "call_function" and n.name in stream for n in part.backward.graph.nodes)

    with tuning.patch(max_recompute_span=10 ** 6):  # no limit: the whole stream recomputed
        assert recomputed(partition(joint, "min_cut")) >= 7
    with tuning.patch(max_recompute_span=8):
        part = partition(joint, "min_cut")
        assert recomputed(part) <= 4
    assert_partition_matches_autograd(part, joint, half_branch_stream, [h, *weights], torch.randn(8, 16))


def mlp_block(x, w1, w2):
    h = x @ w1
    return torch.nn.functional.gelu(h, approximate="tanh") @ w2


def test_what_a_backward_matmul_reads_is_saved_not_recomputed():
    """gelu(h) feeds a matmul in the forward and w2's gradient matmul in the backward. It is
    in memory in both passes; recomputed, the backward would run a kernel of its own to write
    it again. The partition saves it (as functorch's partitioner does)."""
    x = torch.randn(32, 16, requires_grad=True)
    w1, w2 = (nn.Parameter(torch.randn(16, 16) / 4) for _ in range(2))
    joint = joint_of(mlp_block, x, w1, w2)
    part = partition(joint, "min_cut")
    backward = part.backward.graph
    tangents = [n for n in backward.nodes if n.op == "placeholder"][len(part.saved):]
    on_tangents = set(tangents)
    for n in backward.nodes:
        if any(a in on_tangents for a in n.all_input_nodes):
            on_tangents.add(n)
    for mm in [n for n in backward.nodes if n.target == torch.ops.aten.mm.default]:
        for arg in mm.all_input_nodes:
            while is_view(arg):
                arg = arg.args[0]
            assert arg.op == "placeholder" or arg in on_tangents, f"{mm.name} reads {arg.name}, recomputed"
    assert_partition_matches_autograd(part, joint, mlp_block, [x, w1, w2], torch.randn(32, 16))


def gelu_layers(x, w1, w2, w3):
    for w in (w1, w2, w3):
        x = torch.nn.functional.gelu(x @ w)
    return x


def test_what_only_the_backward_needs_is_computed_beside_its_inputs():
    """The cut saves GELU's derivative instead of its input: ops of the backward that the
    forward now runs. They run just after their inputs, where the kernel computing GELU reads
    the same input, not at the forward's end (which held every layer's input until then,
    and fused the layers' derivatives into one kernel)."""
    x = torch.randn(8, 16, requires_grad=True)
    weights = [nn.Parameter(torch.randn(16, 16) / 4) for _ in range(3)]
    joint = joint_of(gelu_layers, x, *weights)
    part = partition(joint, "min_cut")
    nodes = list(part.forward.graph.nodes)
    output = nodes[-1]
    needed, stack = set(), [o for o in output.args[0][:joint.num_outputs] if isinstance(o, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    moved = [n for n in nodes if n.op == "call_function" and n not in needed and n.all_input_nodes]
    assert len(moved) >= 3 * 5, [n.name for n in moved]  # each layer's erf, exp and their arithmetic
    position = {n: i for i, n in enumerate(nodes)}
    for n in moved:
        last_input = max(position[a] for a in n.all_input_nodes)
        between = nodes[max(last_input, len([p for p in nodes if p.op == "placeholder"]) - 1) + 1:position[n]]
        assert all(b in moved for b in between), f"{n.name} waits behind {[b.name for b in between if b not in moved]}"
    assert_partition_matches_autograd(part, joint, gelu_layers, [x, *weights], torch.randn(8, 16))


def test_dropout_saves_the_seed_of_its_mask():
    """torch.nn.functional.dropout draws its mask with bernoulli into a float tensor; the
    joint graph draws `seeded_rand(seed) < p` instead, from a seed drawn in the forward, and
    the backward draws the mask again from that seed: 8 bytes saved, not a byte an element
    (eager's native_dropout keeps a bool mask), nor four."""
    def fn(x, w):
        return torch.nn.functional.dropout(x @ w, 0.25, training=True)

    x, w = torch.randn(32, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    joint = joint_of(fn, x, w)
    assert not any(n.target is torch.ops.aten.bernoulli.p for n in joint.gm.graph.nodes)
    part = partition(joint, "min_cut")
    saved = [n for n in joint.gm.graph.nodes if n.name in part.saved_nodes and not is_view(n)]  # x.t(), w.t()
    assert [(n.meta["val"].dtype, n.meta["val"].shape) for n in saved] == [(torch.int64, ())], \
        [n.name for n in saved]
    assert sum(n.target is seeded_rand for n in part.backward.graph.nodes) == 1
    outs, (gx, gw) = run_partition(part, joint, [x, w], [torch.ones(32, 16)])
    kept = outs[0] != 0  # where the mask kept an element, the gradient flows scaled by 1 / 0.75
    torch.testing.assert_close(outs[0][kept], (x @ w)[kept] / 0.75)
    torch.testing.assert_close(gw, x.t() @ (kept.float() / 0.75))


def test_a_max_pool_saves_its_argmax_as_bytes():
    """max_pool2d's backward reads each window's argmax as an int8 offset in the window
    (runtime/pool_offsets.py), not the int64 index: resnet50's stem pool at batch 32 saved
    49 MiB of indices, now 6."""
    stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         nn.Conv2d(4, 4, 1))
    x = torch.randn(2, 3, 11, 11, requires_grad=True)
    with tuning.patch(cpu_pool_offsets=True):  # (the CPU keeps aten's pool by default: the next test)
        joint = joint_of(stem, x)
    part = partition(joint, "min_cut")
    saved = [n.meta["val"].dtype for n in joint.gm.graph.nodes if n.name in part.saved_nodes]
    assert torch.int8 in saved and torch.int64 not in saved, saved
    backward_ops = {n.target for n in part.backward.graph.nodes}
    assert torch.ops.aten.max_pool2d_with_indices_backward.default not in backward_ops
    traced = torch.fx.symbolic_trace(stem)
    state = [s.read(traced) for s in module_state(traced)]  # parameters, then the running statistics
    assert_partition_matches_autograd(part, joint, lambda *primals: stem(primals[-1]), [*state, x],
                                      torch.randn(2, 4, 6, 6), wrt=[*stem.parameters(), x])


def test_a_max_pool_on_the_cpu_keeps_aten_indices_by_default():
    """On the CPU, weld's C++ kernel of argmax offsets does not vectorize (tuning.cpu_pool_offsets):
    training keeps aten's pool and backward there, and computes what autograd computes."""
    stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    x = torch.randn(2, 3, 12, 12, requires_grad=True)
    joint = joint_of(stem, x)
    part = partition(joint, "min_cut")
    saved = [n.meta["val"].dtype for n in joint.gm.graph.nodes if n.name in part.saved_nodes]
    assert torch.int64 in saved and torch.int8 not in saved, saved
    traced = torch.fx.symbolic_trace(stem)
    state = [s.read(traced) for s in module_state(traced)]
    assert_partition_matches_autograd(part, joint, lambda *primals: stem(primals[-1]), [*state, x],
                                      torch.randn(2, 4, 6, 6), wrt=[*stem.parameters(), x])


def test_a_max_pool_of_wider_windows_keeps_aten_indices():
    """Windows of more positions than weld's kernels unroll (tuning.max_window) keep
    aten's pool and backward: offsets there would pool a second time, eagerly."""
    pool = nn.MaxPool2d(5, 2, 2)
    x = torch.randn(2, 3, 11, 11, requires_grad=True)
    joint = joint_of(pool, x)
    part = partition(joint, "min_cut")
    saved = [n.meta["val"].dtype for n in joint.gm.graph.nodes if n.name in part.saved_nodes]
    assert torch.int64 in saved and torch.int8 not in saved, saved
    assert_partition_matches_autograd(part, joint, pool, [x], torch.randn(2, 3, 6, 6))
