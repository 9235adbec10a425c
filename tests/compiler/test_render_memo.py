"""A kernel's structure (schedule.structure): what it computes with its buffers named by their
place. The Triton renderer renders each structure once; the later kernels of a repeated block
take the first one's text."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from torchweld.compiler.codegen import triton as triton_codegen
from torchweld.compiler.schedule import structure
from weld_helpers import weld_compile


def _block(x, w, b):
    h = F.layer_norm(x, (x.shape[-1],), w, b)
    return x + torch.softmax(F.gelu(h) * 0.5, -1)


def _blocks(x, *args):
    """Blocks one after another, a matrix product (an extern call) between two: a kernel each."""
    for i in range(0, len(args), 3):
        x = _block(x, *args[i:i + 2]) @ args[i + 2]
    return x


def _inputs(widths):
    """The input and, per block, its weight, bias and the matrix to the next block's width."""
    out = [torch.randn(8, 16, widths[0])]
    for w, after in zip(widths, (*widths[1:], widths[-1])):
        out += [torch.randn(w), torch.randn(w), torch.randn(w, after) / w**0.5]
    return out


WIDTHS = (32, 32, 32, 32, 40, 40, 48, 48)


def _kernels(fn, inputs):
    return weld_compile(make_fx(fn)(*inputs), inputs).schedule.kernels()


def test_kernels_of_repeated_blocks_share_a_structure_and_others_do_not():
    kernels = _kernels(_blocks, _inputs(WIDTHS))
    structures = [structure(k) for k in kernels]
    assert len(kernels) == len(WIDTHS)  # one kernel a block: layer norm, gelu, softmax, residual
    assert len({k.args[0] for k in kernels}) == len(kernels)  # each reads its own buffers
    # the first block reads the graph's input, the later ones a matrix product's result
    assert structures[1] == structures[2] == structures[3] != structures[0]
    assert structures[4] == structures[5] and structures[6] == structures[7]
    assert len(set(structures)) == 4  # another width is another kernel


def test_structure_tells_apart_what_a_rendering_depends_on():
    x = torch.randn(8, 16, 32)

    def one(fn, *inputs):
        (kernel,) = _kernels(fn, inputs)
        return structure(kernel)

    y = torch.randn(8, 16, 32)
    base = one(lambda a, b: a * 2 + b, x, y)
    assert one(lambda c, d: c * 2 + d, x.clone(), y.clone()) == base  # other names, same computation
    assert one(lambda a, b: a * 3 + b, x, y) != base  # a constant
    assert one(lambda a, b: a * 2 - b, x, y) != base  # an op
    assert one(lambda a, b: b * 2 + a, x, y) == base  # a kernel's arguments come in the order it reads them
    assert one(lambda a, b: a * 2 + a + b, x, y) != base  # another read
    assert one(lambda a, b: a * 2 + b, x.double(), y.double()) != base  # a dtype
    assert one(lambda a, b: a * 2 + b, x.transpose(1, 2).contiguous().transpose(1, 2), y) != base  # an index
    assert one(lambda a, b: a * 2 + b, x[:4], y[:4]) != base  # a size
    assert one(lambda a, b: (a * 2 + b).sum(-1), x, y) != base  # a reduction


def _rendered(kernels):
    """Per kernel: (function name, module source, runtime integers, parameters)."""
    out = triton_codegen.TritonRenderer().render_modules(kernels, {})
    return [(name, source, triton_codegen.runtime_ints(k), triton_codegen.kernel_params(k))
            for k, name, source in out]


@pytest.mark.parametrize("widths", [WIDTHS, (24, 32, 40, 40, 48, 48, 56, 56, 56)])
def test_each_structure_is_rendered_once_and_as_if_rendered_afresh(monkeypatch, widths):
    """Rendering repeated kernels once gives what rendering each would: the same function
    names, sources and arguments, families of sizes included (from the third width on a
    family's kernels take their sizes as arguments: a repeat of such a one takes them too)."""
    inputs = _inputs(widths)
    renders = []
    render = triton_codegen.TritonRenderer.render
    monkeypatch.setattr(triton_codegen.TritonRenderer, "render",
                        lambda self, kernel, sizes=None: renders.append(kernel.name) or render(self, kernel, sizes))
    memo = _rendered(_kernels(_blocks, inputs))
    once = len(renders)
    structure = triton_codegen.structure  # no two kernels alike (their families as they are)
    monkeypatch.setattr(triton_codegen, "structure",
                        lambda kernel, numbers=True: object() if numbers else structure(kernel, numbers=False))
    afresh = _rendered(_kernels(_blocks, inputs))
    assert memo == afresh
    assert once < len(renders) - once - 2  # the repeated blocks were rendered once
    assert any("ks0" in params for *_, params in memo) == (len(set(widths)) > 2)
