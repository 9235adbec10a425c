"""torchweld::matvec (one row times a weight on CUDA, runtime/decode_matvec.py) against aten's
product, in Triton's interpreter on the CPU and on CUDA, and where weld's lowering of aten.mm
chooses it: one row, half precision, a weight read across, CUDA, under CUDA graphs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchweld
from tests.conftest import INTERPRETED
from tests.lowering import lowered_externs
from torchweld.runtime import decode_matvec

# (n, k): columns not a multiple of the block, k shorter than a step, k not a multiple of it
SHAPES = [(40, 48), (17, 100), (9, 1500)]


@pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter (on a GPU machine: the CUDA test)")
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_in_tritons_interpreter(n, k, dtype):
    weight = torch.randn(n, k, dtype=dtype)
    x = torch.randn(3, k, dtype=dtype)[1:2]  # a row of a larger tensor
    out = torch.full((1, n), float("nan"), dtype=dtype)
    for config in {decode_matvec.launch_config(n, k, 132), (1, 64, 2), (4, 512, 2)}:
        decode_matvec.launch(x, weight.t(), out, config)
        torch.testing.assert_close(out.float(), x.float() @ weight.float().t(), atol=2e-2, rtol=2e-2)


def test_launch_configs_follow_the_h200_measurements():
    """The configuration bench/investigations/matvec.py found fastest (or within 4%) on the
    H200 (132 multiprocessors) for a 0.85B Llama's products."""
    assert decode_matvec.launch_config(512, 2048, 132) == (1, 1024, 2)  # k / v projections
    assert decode_matvec.launch_config(2048, 2048, 132) == (1, 1024, 2)  # q / o
    assert decode_matvec.launch_config(5632, 2048, 132) == (4, 1024, 2)  # gate / up
    assert decode_matvec.launch_config(32000, 2048, 132) == (4, 1024, 2)  # output layer
    assert decode_matvec.launch_config(64, 40, 132) == (1, 64, 2)  # a short row: one step


def test_tensors_it_does_not_take_go_to_atens_product():
    weight = torch.randn(8, 32, dtype=torch.bfloat16)
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    assert not decode_matvec.supported(x, weight.t())  # the CPU
    torch.testing.assert_close(decode_matvec.matvec(x, weight.t()), x @ weight.t())
    two_rows = torch.randn(2, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(decode_matvec.matvec(two_rows, weight.t()), two_rows @ weight.t())


def _externs_lowered(device: str, dtype=torch.bfloat16, rows=1, linear=True, cuda_graphs=True,
                     columns=decode_matvec.MIN_COLUMNS) -> list[str]:
    def fn(x, weight):
        return (F.linear(x, weight) if linear else x @ weight).relu()

    def make_args():
        weight = torch.randn(*((columns, 64) if linear else (64, columns)), dtype=dtype, device=device)
        return [torch.randn(rows, 1, 64, dtype=dtype, device=device), weight]

    return lowered_externs(fn, make_args, cuda_graphs)


def test_weld_chooses_it_for_one_half_precision_row_on_cuda_graphs_only():
    assert _externs_lowered("cuda") == ["torchweld.matvec.default"]
    assert _externs_lowered("cuda", cuda_graphs=False) == ["aten.mm.default"]  # launched from Python at each call
    assert _externs_lowered("cuda", torch.float16) == ["torchweld.matvec.default"]
    assert _externs_lowered("cpu") == ["aten.mm.default"]
    assert _externs_lowered("cuda", torch.float32) == ["aten.mm.default"]
    assert _externs_lowered("cuda", rows=2) == ["aten.mm.default"]
    assert _externs_lowered("cuda", columns=decode_matvec.MIN_COLUMNS - 1) == ["aten.mm.default"]  # too narrow
    assert _externs_lowered("cuda", linear=False) == ["aten.mm.default"]  # a weight read along its rows


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 512, bias=False)  # at least decode_matvec.MIN_COLUMNS outputs
        self.down = nn.Linear(512, 64, bias=True)
        self.head = nn.Linear(64, 1000, bias=False)

    def forward(self, x):
        return self.head(x + self.down(F.silu(self.up(x))))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_weld_on_cuda_equals_eager_at_batch_one_and_two(mode):
    model = Decoder().cuda().to(torch.bfloat16)
    compiled = torchweld.compile(model, backend="weld", mode=mode)
    with torch.no_grad():
        for rows in (1, 1, 1, 2, 1):
            x = torch.randn(rows, 1, 64, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x).float(), model(x).float(), atol=3e-2, rtol=3e-2)
        model.head.weight.mul_(-1)  # a weight changed in place: read again, not kept
        x = torch.randn(1, 1, 64, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x).float(), model(x).float(), atol=3e-2, rtol=3e-2)


def test_weights_of_2_to_the_31_elements_are_not_taken():
    """The kernel's offsets are 32-bit: a 270000-word output layer of width 8192 goes to aten."""
    x = torch.empty(1, 8192, dtype=torch.bfloat16, device="meta")
    assert not decode_matvec.offsets_fit(x, torch.empty(270000, 8192, dtype=torch.bfloat16, device="meta").t())
    assert decode_matvec.offsets_fit(x, torch.empty(32000, 8192, dtype=torch.bfloat16, device="meta").t())
