"""torchweld::embedding_dense_backward (atomic adds on CUDA) against aten's, and where the
weld lowering chooses it: float32 CUDA gradients only."""
import pytest
import torch
import torch.nn as nn

import torchweld
from tests.lowering import lowered_externs
from torchweld.runtime.embedding_backward import atomics_fit, embedding_dense_backward

aten = torch.ops.aten


@pytest.mark.parametrize("padding_idx", [-1, 3])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_equals_aten_with_repeated_indices_and_a_padding_row(padding_idx, index_dtype):
    grad = torch.randn(6, 9, 16).transpose(0, 1)  # not contiguous
    indices = torch.randint(0, 12, (9, 6), dtype=index_dtype)
    indices[0, :3] = 3  # the padding row, several times
    indices[1, :] = 5  # one row from many tokens
    got = embedding_dense_backward(grad, indices, 12, padding_idx, False)
    expected = aten.embedding_dense_backward(grad, indices, 12, padding_idx, False)
    torch.testing.assert_close(got, expected)
    if padding_idx >= 0:
        assert not got[padding_idx].any()


@pytest.mark.parametrize("case", ["scale_grad_by_freq", "float16", "deterministic"])
def test_aten_runs_where_atomics_would_differ(case):
    grad = torch.randn(5, 8, dtype=torch.float16 if case == "float16" else torch.float32)
    indices = torch.tensor([0, 2, 2, 4, 1])
    scale = case == "scale_grad_by_freq"
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(case == "deterministic")
    try:
        assert not atomics_fit(grad, scale)
        got = embedding_dense_backward(grad, indices, 6, -1, scale)
    finally:
        torch.use_deterministic_algorithms(before)
    assert atomics_fit(grad.float(), False)
    torch.testing.assert_close(got, aten.embedding_dense_backward(grad, indices, 6, -1, scale))


def _externs_lowered_on(device: str, dtype=torch.float32, scale_grad_by_freq=False) -> list[str]:
    def fn(grad, indices):
        return aten.embedding_dense_backward(grad, indices, 10, -1, scale_grad_by_freq) * 2

    return lowered_externs(fn, lambda: [torch.randn(4, 5, 8, dtype=dtype, device=device),
                                        torch.randint(0, 10, (4, 5), device=device)])


def test_weld_chooses_atomic_adds_for_float32_cuda_gradients_only():
    assert _externs_lowered_on("cuda") == ["torchweld.embedding_dense_backward.default"]
    assert _externs_lowered_on("cpu") == ["aten.embedding_dense_backward.default"]
    assert _externs_lowered_on("cuda", torch.float16) == ["aten.embedding_dense_backward.default"]
    assert _externs_lowered_on("cuda", scale_grad_by_freq=True) == ["aten.embedding_dense_backward.default"]


class TokensAndPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(100, 32, padding_idx=0)
        self.positions = nn.Embedding(16, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.norm(self.tokens(ids) + self.positions(positions)).relu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_weld_embedding_gradients_on_cuda_equal_eager(mode):
    torch.manual_seed(0)
    model = TokensAndPositions().cuda()
    reference = TokensAndPositions().cuda()
    reference.load_state_dict(model.state_dict())
    compiled = torchweld.compile(model, backend="weld", mode=mode)
    for batch, length in ((4, 16), (4, 16), (3, 12)):  # a replay (under CUDA graphs), then a new shape
        ids = torch.randint(0, 100, (batch, length), device="cuda")
        ids[:, :2] = 7  # rows many tokens share
        ids[0, -1] = 0  # the padding row
        compiled(ids).square().sum().backward()
        reference(ids).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
            p.grad = q.grad = None
