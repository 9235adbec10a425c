"""fake_copy (torchweld/fake_tensors.py): the fake a tensor gets is the one torch's
MetaConverter would give it, whichever path makes it; tied weights stay one constant."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from torchweld.compiler.aten_graph import to_aten_graph
from torchweld.fake_tensors import _is_simple, fake_copy


def _described(t):
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad, t.is_leaf,
            isinstance(t, torch.nn.Parameter))


def _base():
    return torch.randn(6, 4)


CASES = {  # name -> (make the tensor, whether the direct path takes it)
    "parameter": (lambda: torch.nn.Parameter(torch.randn(5, 3)), True),
    "buffer": (lambda: torch.nn.parameter.Buffer(torch.arange(4)), True),
    "channels-last": (lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), True),
    "own strides": (lambda: torch.empty_strided((3, 4), (1, 3)), True),
    "0-d": (lambda: torch.tensor(2.5, dtype=torch.float64), True),
    "zero-size": (lambda: torch.empty(0, 3), True),
    "half": (lambda: torch.randn(3, 3).half(), True),
    "view": (lambda: _base()[1:], False),
    "transposed view": (lambda: _base().t(), False),
    "expanded": (lambda: torch.randn(3, 1).expand(3, 4), False),
    "non-leaf": (lambda: torch.randn(3, requires_grad=True) * 2, False),
    "conjugate": (lambda: torch.randn(3, dtype=torch.complex64).conj(), False),
    "inference": (lambda: _inference_tensor(), False),
}


def _inference_tensor():
    with torch.inference_mode():
        return torch.randn(3)


@pytest.mark.parametrize("name", list(CASES))
def test_fake_copy_matches_from_tensor(name):
    make, direct = CASES[name]
    real = make()
    assert _is_simple(real) == direct
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ours, theirs = fake_copy(mode, real), mode.from_tensor(real, static_shapes=True)
    assert isinstance(ours, FakeTensor) and ours.fake_mode is mode
    assert _described(ours) == _described(theirs) == _described(real)
    with mode:  # and it computes like one
        assert _described(ours * 2) == _described(theirs * 2)


def test_tied_weights_stay_one_constant():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.head = torch.nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    model = Tied().eval()
    ids = torch.randint(0, 10, (2, 5))
    with torch.no_grad():
        graph = to_aten_graph(torch.fx.symbolic_trace(model), [ids])
        constants = [n for n in graph.gm.graph.nodes if n.op == "get_attr"]
        assert len(constants) == 1 and getattr(graph.gm, constants[0].target) is model.embed.weight
        torch.testing.assert_close(graph.gm(ids)[0], model(ids))
