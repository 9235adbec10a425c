"""Which graphs weld compiles over symbols on this device, and why not where it does not:
GPT-2 and BERT (tiny or full) over a few sequence lengths and the small programs of
tests/backends/test_weld_symbolic.py, with the `dynamic` log on.

    python bench/investigations/symbolic_diag.py [--device cuda] [--full]
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torchweld  # noqa: E402
from tests.backends.test_weld_symbolic import PROGRAMS, _symbolic  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="the models' real sizes (else tiny configs)")
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("torchweld.dynamic").setLevel(logging.DEBUG)  # (with the traceback of a failed compile)
    device = torch.device(args.device)
    for name, (program, make) in sorted(PROGRAMS.items()):
        fn = torchweld.compile(program, backend="weld", dynamic=True)
        try:
            for n in (5, 9, 17, 33):
                inputs = tuple(a.to(device) for a in make(n))
                torch.testing.assert_close(fn(*inputs), program(*inputs), atol=1e-5, rtol=1e-4)
            found = _symbolic(fn)
            print(f"{name}: over symbols, guard {found.guard.text}; per size {found.per_size.compiles}, "
                  f"as captured {found.per_size.calls_as_captured}")
        except Exception as e:  # noqa: BLE001 - a diagnosis goes on
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    models = {"gpt2": GPT2Model(GPT2Config() if args.full else GPT2Config(n_embd=64, n_layer=2, n_head=4)),
              "bert": BertModel(BertConfig() if args.full else BertConfig(hidden_size=64, num_hidden_layers=2,
                                                                          num_attention_heads=4,
                                                                          intermediate_size=128))}
    for name, model in models.items():
        model = model.eval().to(device)
        fn = torchweld.compile(model, backend="weld")
        with torch.no_grad():
            for t in (52, 229, 420, 247, 33):
                ids = torch.randint(0, 1000, (8, t), device=device)
                diff = (fn(input_ids=ids).last_hidden_state - model(input_ids=ids).last_hidden_state).abs().max()
                print(f"{name} {t}: max diff {diff.item():.2e}")


if __name__ == "__main__":
    main()
