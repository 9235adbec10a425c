"""Ahead-of-time Triton compiles and direct launches (runtime/triton_launch.py,
compiler/codegen/triton_launches.py). Kernel naming by content is checked on the
CPU through Triton's interpreter; the compiled launchers need CUDA."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "compiler"))
from weld_helpers import check, weld_compile  # noqa: E402

triton = pytest.importorskip("triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled launchers need CUDA")


def _two_identical_kernels(x, w):
    a = torch.sin(x) * 2  # a kernel
    b = a @ w  # an extern between them
    return torch.sin(b) * 2  # the same kernel text: the same shapes and pointers


def test_identical_kernels_are_one_function():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU variant runs Triton's interpreter")
    c = check(_two_identical_kernels, [torch.randn(16, 16), torch.randn(16, 16)], options={"cpu_codegen": "triton"})
    source = c.kernel_sources["triton"]
    assert source.count("@triton.jit") == 1
    assert "call_jit" not in c.wrapper_source  # no compiled launchers through the interpreter


@cuda
def test_fast_launch_matches_eager_and_compiles_identical_kernels_once():
    from torchweld.runtime import triton_launch

    x, w = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    before = len(triton_launch._compiled)
    c = check(_two_identical_kernels, [x, w])
    assert "_run_" in c.wrapper_source and "def call_jit(" in c.wrapper_source
    assert len(triton_launch._compiled) - before <= 1  # one kernel text, one config, aligned pointers
    c2 = weld_compile(_two_identical_kernels, [x, w])  # a second graph reuses the compiled kernel
    assert len(triton_launch._compiled) - before <= 1
    check(_two_identical_kernels, [x, w], compiled=c2)


@cuda
def test_size_generic_kernels_launch_with_their_element_count():
    """One compiled function for three sizes, launched through the compiled launcher with
    each call site's count: one size divisible by 16 (Triton's divisibility class), two not."""
    from torchweld.runtime import triton_launch

    def fn(a, b, c):
        return [torch.sigmoid(a) * 2, torch.sigmoid(b) * 2, torch.sigmoid(c) * 2]

    before = len(triton_launch._compiled)
    c = check(fn, [torch.randn(100, device="cuda"), torch.randn(3, 37, device="cuda"),
                   torch.randn(4096, device="cuda")])
    assert "xnumel" in c.kernel_sources["triton"] and "_run_" in c.wrapper_source
    for count in (100, 111, 4096):  # after the pointers, each call site's own count
        assert f".data_ptr(), {count}, " in c.wrapper_source
    assert len(triton_launch._compiled) - before <= 2  # one function: a compile per divisibility class


@cuda
def test_misaligned_input_runs_the_jit_launches():
    def fn(a, b):
        return torch.sigmoid(a) * b + 1

    base = torch.randn(4097, device="cuda")
    aligned, b = base[:4096], torch.randn(4096, device="cuda")
    c = check(fn, [aligned, b])
    misaligned = base[1:]  # 4 bytes past an aligned start
    check(fn, [misaligned, b], compiled=c)


@cuda
def test_fast_launch_under_cuda_graph_capture():
    def fn(a):
        return (a * 3).relu().sum(1)

    x = torch.randn(32, 100, device="cuda")
    c = weld_compile(fn, [x])
    with torch.no_grad():
        c(x)  # warm up
        graph, static_x = torch.cuda.CUDAGraph(), x.clone()
        with torch.cuda.graph(graph):
            out = c(static_x)
        static_x.copy_(x * 2)
        graph.replay()
        torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, fn(x * 2))


@cuda
def test_max_autotune_compiles_candidates_ahead():
    from torchweld.runtime.autotune import Autotuner

    tuner = Autotuner(timer=lambda fn: (fn(), 1.0)[1])
    x = torch.randn(300, 77, device="cuda")
    check(lambda a: (a.exp() * 2).sum(1), [x], options={"max_autotune": True, "autotuner": tuner})


class _FakeLauncher:
    """What `CompiledKernel.run` is: a Python object around the compiled C `launch`."""

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.launch = object()
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, profile_scratch_size


class _FakeMetadata:
    num_ctas, num_warps, shared, launch_cooperative_grid, launch_pdl = 1, 4, 0, False, False
    global_scratch_size = profile_scratch_size = 0
    tensordesc_meta = None


class _FakeKernel:
    def __init__(self, launcher, **metadata):
        self.run, self.function, self.packed_metadata = launcher, 7, ("packed",)
        self.name, self.kernel = "k_fake", b"cubin"
        self.metadata = _FakeMetadata()
        self.metadata.__dict__.update(metadata)


def test_launch_handles_call_a_c_launcher_only_where_its_convention_is_known(monkeypatch):
    from torchweld.runtime import triton_launch

    constexprs, cpu = (64, 1), torch.device("cpu")
    monkeypatch.setattr(triton_launch, "_direct_launch_form", lambda: "3.6")
    own = triton_launch.kernel_launcher()
    if own is not None:  # weld's own launcher: the binary loaded here, the pointers then two null scratch pointers
        monkeypatch.setattr(triton_launch, "_load_binary", lambda name, cubin, metadata, device: 1234)
        handle = triton_launch.launch_handle(_FakeKernel(_FakeLauncher(), shared=512), constexprs, cpu)
        assert handle == triton_launch.LaunchHandle(own.launch, 1234, (128, 512), (0, 0), takes_constants=False)
        assert handle.passed((16, 1, 5)) == (16, 5)  # Triton made the 1 a constant: the binary takes no value for it
    pdl = _FakeKernel(_FakeLauncher(), launch_pdl=True)  # not a plain launch: Triton's C launcher, called directly
    handle = triton_launch.launch_handle(pdl, constexprs, cpu)
    assert handle.launch is pdl.run.launch and handle.function == 7 and handle.trailing == constexprs
    assert handle.leading == (False, True, None, None, ("packed",), None, None, None)
    scratch = _FakeKernel(_FakeLauncher(global_scratch_size=128), global_scratch_size=128)  # Triton allocates it
    assert triton_launch.launch_handle(scratch, constexprs, cpu).launch is scratch.run
    monkeypatch.setattr(triton_launch, "_direct_launch_form", lambda: None)  # another Triton
    handle = triton_launch.launch_handle(pdl, constexprs, cpu)
    assert handle.launch is pdl.run and handle.leading == (("packed",), None, None, None)
    assert handle.passed((16, 1, 5)) == (16, 1, 5)  # Triton's launcher takes a value for each constant


def test_a_workers_binary_is_launched_by_weld_only_where_a_plain_launch_does(monkeypatch):
    """A worker sends back its compiled kernel's cubin and launch metadata: the parent loads
    that binary itself (no compile of its own out of Triton's cache) where its own launcher
    can launch it, and otherwise (None) goes through Triton as before."""
    from torchweld.runtime import triton_launch

    own = triton_launch.kernel_launcher()
    if own is None:
        pytest.skip("no C compiler here")
    cpu = torch.device("cpu")
    loaded = []
    monkeypatch.setattr(triton_launch, "_direct_launch_form", lambda: "3.6")
    monkeypatch.setattr(triton_launch, "_load_binary",
                        lambda name, cubin, metadata, device: loaded.append((name, cubin)) or 99)
    plain = {"name": "k_abc", "cubin": b"\x7fELF", **{k: v for k, v in vars(_FakeMetadata).items()
                                                      if not k.startswith("_")}, "shared": 256}
    assert triton_launch.handle_from_binary(plain, cpu) == triton_launch.LaunchHandle(own.launch, 99, (128, 256), (0, 0),
                                                                                      takes_constants=False)
    assert loaded == [("k_abc", b"\x7fELF")]
    assert triton_launch.handle_from_binary({**plain, "launch_pdl": True}, cpu) is None
    assert triton_launch.handle_from_binary({**plain, "global_scratch_size": 64}, cpu) is None
    assert triton_launch.handle_from_binary({"name": "k_abc", "cubin": b""}, cpu) is None  # metadata unknown
    monkeypatch.setattr(triton_launch, "_load_binary", lambda name, cubin, metadata, device: None)  # does not fit
    assert triton_launch.handle_from_binary(plain, cpu) is None
    monkeypatch.setattr(triton_launch, "_direct_launch_form", lambda: None)  # another Triton
    assert triton_launch.handle_from_binary(plain, cpu) is None


def test_own_launcher_checks_its_arguments_without_a_gpu():
    from torchweld.runtime import triton_launch

    own = triton_launch.kernel_launcher()
    if own is None:
        pytest.skip("no C compiler here")
    assert own.launch(0, 1, 1, 0, 0, 128, 0, 16, 32) is None  # an empty grid launches nothing
    assert own.launch(0, 1, 1, 0, 0, 128, 0, 16, -3, 2**40) is None  # a negative offset, an int64 divisor
    with pytest.raises(TypeError):
        own.launch(1, 1, 1)
    with pytest.raises(TypeError):
        own.launch(1, 1, 1, 0, 0, 128, 0, 16, "32")  # parameters are ints


def test_kernels_are_handed_to_the_compilers_as_they_are_rendered(monkeypatch):
    """TritonCompile submits each kernel's job while the rest are still rendered (batch = the
    graph's kernel count, which decides on worker processes), and finish() waits on the very
    same jobs; here the ahead-of-time compile is made to fail, so the JIT lines run, and the
    result still equals eager's."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU variant runs Triton's interpreter")
    from torchweld.compiler.codegen import triton as triton_codegen
    from torchweld.runtime import triton_launch

    events = []
    render = triton_codegen.TritonRenderer.render

    def rendering(self, kernel, sizes=None):
        events.append(("render", kernel.name))
        return render(self, kernel, sizes)

    def submit(jobs, batch=None):
        events.append(("submit", jobs[0], batch))
        return []

    def compile_all(jobs):
        events.append(("finish", jobs))
        raise RuntimeError("no ahead-of-time compile on this machine")

    monkeypatch.setattr(triton_codegen.TritonRenderer, "render", rendering)
    monkeypatch.setattr(triton_launch, "fast_launch_available", lambda device: True)
    monkeypatch.setattr(triton_launch, "submit_kernels", submit)
    monkeypatch.setattr(triton_launch, "compile_kernels", compile_all)

    def fn(x, w):
        return torch.cos(torch.sin(x) @ w).sum(0) + 1

    check(fn, [torch.randn(16, 16), torch.randn(16, 16)], options={"cpu_codegen": "triton"})
    kinds = [e[0] for e in events]
    submitted = [e[1] for e in events if e[0] == "submit"]
    assert kinds.count("render") == len(submitted) >= 2 and kinds[-1] == "finish"
    assert kinds[1] == "submit"  # the first kernel is submitted before the second is rendered
    assert all(e[2] == len(submitted) for e in events if e[0] == "submit")
    assert events[-1][1] == submitted and all(a is b for a, b in zip(events[-1][1], submitted))
