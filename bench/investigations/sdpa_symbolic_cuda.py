"""Why GPT-2 and BERT do not compile over symbols on CUDA: which aten op fails in the trace
("SymIntArrayRef expected to contain only concrete integers"), with what arguments, and which
guard makes a sequence length a number. Probes the SDPA ops one by one on symbolic fakes, then
compiles tiny GPT-2 / BERT with the recorder and the ShapeEnv instrumented (each pin of a symbol
to a number printed with its Python and C++ stacks); `--block`: tests/models.Block's causal
attention, inference and a training step, over sequence lengths.

    TORCH_SHOW_CPP_STACKTRACES=1 python bench/investigations/sdpa_symbolic_cuda.py [--device cuda]
        [--full] [--no-probe] [--no-instrument] [--block]
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torchweld  # noqa: E402
from torchweld.capture.symbolic_sizes import SizeSource  # noqa: E402
from torchweld.compiler import aten_trace  # noqa: E402

aten = torch.ops.aten
NESTING: list = []  # the recorder's ops being dispatched, outer first
CPP_GUARDS = [12]  # the C++ stacks of at most this many guards (symbolizing one takes a while)


def describe(x):
    if isinstance(x, torch.Tensor):
        return (f"T{tuple(x.shape)} st{tuple(x.stride())} off{x.storage_offset()} {str(x.dtype)[6:]} "
                f"{x.device.type}")
    if isinstance(x, (list, tuple)):
        return type(x)(describe(v) for v in x)
    if isinstance(x, dict):
        return {k: describe(v) for k, v in x.items()}
    return x


def short_stack(limit=40):
    keep = ("torchweld", "transformers", "eval_with_key", "<string>", "_decomp", "_refs", "_meta_registrations",
            "fake_impls", "investigations",
            "functional.py", "_prims")
    frames = [f for f in traceback.extract_stack()[:-2] if any(k in f.filename for k in keep)]
    return "\n".join(f"      {Path(f.filename).name}:{f.lineno} {f.name}: {f.line}" for f in frames[-limit:])


def cpp_stack(limit=30):
    """The C++ frames of the current stack that name aten code (where a C++ kernel asked a size)."""
    from torch.utils._traceback import CapturedTraceback

    lines = "".join(CapturedTraceback.extract(cpp=True).format()).splitlines()
    keep = [ln.strip()[:300] for ln in lines if ("at::" in ln or "sdp" in ln) and "Dispatcher" not in ln
            and "boxed" not in ln.lower()]
    return "\n".join(f"      C++ {ln}" for ln in keep[:limit])


def instrument():
    original = aten_trace.AtenRecorder.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        NESTING.append(func)
        name = str(func)
        if "attention" in name or "sdp" in name or "pad" in name:
            print(f"  [op] {' > '.join(map(str, NESTING))}: {describe(args)} {describe(kwargs or {})}")
        try:
            return original(self, func, types, args, kwargs)
        except Exception as e:
            if not getattr(e, "_told", False):
                e._told = True
                print(f"  [FAILED] {' > '.join(map(str, NESTING))}\n    args {describe(args)} {describe(kwargs or {})}"
                      f"\n    {type(e).__name__}: {str(e)[:4000]}")
            raise
        finally:
            NESTING.pop()

    aten_trace.AtenRecorder.__torch_dispatch__ = dispatch

    from torchweld.compiler import driver
    to_aten_graph = driver.to_aten_graph

    def traced(gm, example_inputs):
        if any(isinstance(x, torch.Tensor) and any(isinstance(n, torch.SymInt) for n in x.shape)
               for x in example_inputs):
            print("  [graph traced over symbols]\n" + gm.code)
        return to_aten_graph(gm, example_inputs)

    driver.to_aten_graph = traced

    set_replacement = ShapeEnv._set_replacement

    def replaced(self, a, tgt, msg):
        if getattr(tgt, "is_number", False):
            print(f"  [PINNED] {a} := {tgt} ({msg}) in ops {' > '.join(map(str, NESTING))}\n{short_stack(12)}\n"
                  f"{cpp_stack()}")
        return set_replacement(self, a, tgt, msg)

    ShapeEnv._set_replacement = replaced

    log_guard = ShapeEnv._log_guard

    def guard(self, prefix, g, forcing_spec):
        print(f"  [guard] {g} in ops {' > '.join(map(str, NESTING[-3:]))}")
        if NESTING and CPP_GUARDS[0] > 0:
            CPP_GUARDS[0] -= 1
            print(cpp_stack(12))
        return log_guard(self, prefix, g, forcing_spec)

    ShapeEnv._log_guard = guard


def probe_ops(device):
    """The SDPA ops on fakes whose length is a symbol, GPT-2's layout (a split of one (B, S, 3E)
    product, transposed) and BERT's (B, H, S, D) with a (B, 1, 1, S) float mask expanded."""
    print("== probes on symbolic fakes")
    for kind in ("bool_causal", "float_bert", "none"):
        for choice in ("sdpa", "_fused_sdp_choice", "efficient", "cudnn", "flash", "math"):
            env = ShapeEnv()
            mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
            sym = env.create_symbol(52, SizeSource("arg0", 1), dynamic_dim=DimDynamic.DYNAMIC)
            s = env.create_symintnode(sym, hint=52)
            B, H, D = 8, 4, 16
            with mode:
                if kind == "bool_causal":
                    qkv = torch.empty(B, s, 3 * H * D, device=device)
                    q, k, v = (t.view(B, s, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
                    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None].expand(B, 1, s, s)
                elif kind == "float_bert":
                    q, k, v = (torch.empty(B, s, H, D, device=device).transpose(1, 2) for _ in range(3))
                    mask = torch.zeros(B, 1, 1, s, device=device).expand(B, 1, s, s)
                else:
                    q, k, v = (torch.empty(B, H, s, D, device=device) for _ in range(3))
                    mask = None
                try:
                    if choice == "sdpa":
                        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    elif choice == "_fused_sdp_choice":
                        out = aten._fused_sdp_choice(q, k, v, mask)
                    elif choice == "efficient":
                        out = aten._scaled_dot_product_efficient_attention(q, k, v, mask, False)
                    elif choice == "cudnn":
                        out = aten._scaled_dot_product_cudnn_attention(q, k, v, mask, False)
                    elif choice == "flash":
                        out = aten._scaled_dot_product_flash_attention(q, k, v)
                    else:
                        out = aten._scaled_dot_product_attention_math(q, k, v, mask)
                    print(f"  {kind} {choice}: ok {describe(out)}; guards {[str(g.expr) for g in env.guards]}; "
                          f"replacements {env.replacements}")
                except Exception as e:  # noqa: BLE001
                    print(f"  {kind} {choice}: {type(e).__name__}: {str(e)[:1500]}")


def models(device, full):
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model
    from tests.backends.test_weld_symbolic import _symbolic

    made = {"gpt2": GPT2Model(GPT2Config() if full else GPT2Config(n_embd=64, n_layer=2, n_head=4)),
            "bert": BertModel(BertConfig() if full else BertConfig(hidden_size=64, num_hidden_layers=2,
                                                                   num_attention_heads=4, intermediate_size=128))}
    for name, model in made.items():
        print(f"== {name}")
        model = model.eval().to(device)
        fn = torchweld.compile(model, backend="weld")
        with torch.no_grad():
            for t in (52, 229, 33):
                ids = torch.randint(0, 1000, (8, t), device=device)
                print(f"-- {name} length {t}")
                diff = (fn(input_ids=ids).last_hidden_state - model(input_ids=ids).last_hidden_state).abs().max()
                print(f"{name} {t}: max diff {diff.item():.2e}")
        try:
            found = _symbolic(fn)
            print(f"{name}: over symbols, guard {found.guard.text}; per size {found.per_size.compiles}")
        except Exception as e:  # noqa: BLE001
            print(f"{name}: no compile over symbols ({type(e).__name__}: {e})")


def blocks(device):
    """tests/models.Block (its causal attention, which fuse_attention makes one SDPA with a boolean
    mask), its mask made on the input's device (the test model makes it on the CPU, which eager
    refuses for CUDA inputs), in inference and a training step, over sequence lengths."""
    import copy

    from tests.backends.test_weld_symbolic import _symbolic
    from tests.models import Block

    class DeviceBlock(Block):
        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            h = self.heads
            q, k, v = (t.reshape(b, s, h, d // h).transpose(1, 2) for t in (q, k, v))
            scores = q @ k.transpose(-2, -1) / (d // h) ** 0.5
            scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool, device=x.device).tril(), float("-inf"))
            y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, d)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    for training in (False, True):
        torch.manual_seed(0)
        block = DeviceBlock(d=16, heads=2, causal=True).to(device).train(training)
        reference = copy.deepcopy(block)
        fn = torchweld.compile(block, backend="weld")
        for t in (7, 10, 13, 9, 300, 7):
            x = torch.randn(2, t, 16, device=device, requires_grad=training)
            with torch.set_grad_enabled(training):
                out, expected = fn(x), reference(x)
                torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
                if training:
                    out.square().sum().backward()
                    expected.square().sum().backward()
                    for p, q in zip(block.parameters(), reference.parameters()):
                        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)
                        p.grad = q.grad = None
        found = _symbolic(fn)
        print(f"block training={training}: equal to eager; over symbols, guard {found.guard.text[:300]}; "
              f"per size {found.per_size.compiles}, as captured {found.per_size.calls_as_captured}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--no-instrument", action="store_true")
    parser.add_argument("--block", action="store_true", help="tests/models.Block, inference and training")
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("torchweld.dynamic").setLevel(logging.DEBUG)
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
    if args.device == "cuda":
        print("capability", torch.cuda.get_device_capability(), "flash", torch.backends.cuda.flash_sdp_enabled(),
              "mem_eff", torch.backends.cuda.mem_efficient_sdp_enabled(), "cudnn",
              torch.backends.cuda.cudnn_sdp_enabled(), "math", torch.backends.cuda.math_sdp_enabled())
        q = torch.randn(8, 4, 52, 16, device="cuda")
        m = torch.ones(52, 52, dtype=torch.bool, device="cuda").tril()[None, None].expand(8, 1, 52, 52)
        print("eager choice: mask", torch._fused_sdp_choice(q, q, q, m), "none", torch._fused_sdp_choice(q, q, q),
              "(0 math, 1 flash, 2 efficient, 3 cudnn)")
    if not args.no_probe:
        probe_ops(args.device)
    if args.block:
        blocks(args.device)
    if not args.no_instrument:
        instrument()
    models(args.device, args.full)


if __name__ == "__main__":
    main()
