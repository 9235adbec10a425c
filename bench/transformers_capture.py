"""How many graphs capture makes of real model code: tiny configs of transformers families,
torchweld's capture against torch.compile's (dynamo), each with a backend that only counts
the graphs and runs them eagerly. Also checks the output against eager.

    .venv/bin/python bench/transformers_capture.py [--train] [--eager-attention] [--record] [family ...]

A family with more graphs than torch.compile's is marked `<<<` and the first distinct break
reasons follow it. With --train, each family's training step (forward, `out.square().mean()`,
backward; every dropout probability set to 0, so that neither side draws) is compiled with
the weld backend and compared with eager's: outputs and every parameter's gradient.
With --eager-attention, each model runs transformers' classic attention path
(`config._attn_implementation = "eager"`) instead of the default (sdpa). With --record,
the rows are appended to bench/records/capture.jsonl.
Needs `transformers` (in the test extras).
"""
from __future__ import annotations

import logging
import os
import sys
import time
import warnings

import torch
import transformers as t

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torchweld  # noqa: E402
from tests.capture.helpers import CountingBackend  # noqa: E402

WIDTH = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2)
DECODER = dict(WIDTH, num_key_value_heads=2, vocab_size=1000)
FAMILIES = {
    "bert": lambda: t.BertModel(t.BertConfig(**WIDTH)),
    "gpt2": lambda: t.GPT2Model(t.GPT2Config(n_layer=2, n_embd=64, n_head=4)),
    "distilbert": lambda: t.DistilBertModel(t.DistilBertConfig(n_layers=2, dim=64, hidden_dim=128, n_heads=4)),
    "roberta": lambda: t.RobertaModel(t.RobertaConfig(**WIDTH)),
    "albert": lambda: t.AlbertModel(t.AlbertConfig(embedding_size=32, **WIDTH)),
    "electra": lambda: t.ElectraModel(t.ElectraConfig(embedding_size=32, **WIDTH)),
    "deberta_v2": lambda: t.DebertaV2Model(t.DebertaV2Config(**WIDTH)),
    "mobilebert": lambda: t.MobileBertModel(t.MobileBertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, embedding_size=32,
        intra_bottleneck_size=32, true_hidden_size=32, vocab_size=1000)),
    "t5": lambda: t.T5EncoderModel(t.T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16)),
    "bart_encoder": lambda: t.BartModel(t.BartConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000)).encoder,
    "llama": lambda: t.LlamaModel(t.LlamaConfig(**DECODER)),
    "mistral": lambda: t.MistralModel(t.MistralConfig(**DECODER)),
    "qwen2": lambda: t.Qwen2Model(t.Qwen2Config(**DECODER)),
    "phi": lambda: t.PhiModel(t.PhiConfig(**DECODER)),
    "gemma": lambda: t.GemmaModel(t.GemmaConfig(head_dim=16, **DECODER)),
    "falcon": lambda: t.FalconModel(t.FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                                   vocab_size=1000)),
    "bloom": lambda: t.BloomModel(t.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=1000)),
    "opt": lambda: t.OPTModel(t.OPTConfig(hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2,
                                          vocab_size=1000, word_embed_proj_dim=64)),
    "gpt_neo": lambda: t.GPTNeoModel(t.GPTNeoConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=1000,
                                                    attention_types=[[["global", "local"], 1]])),
    "vit": lambda: t.ViTModel(t.ViTConfig(image_size=32, patch_size=8, **WIDTH)),
    "clip_vision": lambda: t.CLIPVisionModel(t.CLIPVisionConfig(image_size=32, patch_size=8, **WIDTH)),
    "convnext": lambda: t.ConvNextModel(t.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])),
    "swin": lambda: t.SwinModel(t.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                             num_heads=[2, 2], window_size=4)),
    "resnet": lambda: t.ResNetModel(t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])),
    "segformer": lambda: t.SegformerModel(t.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])),
    "wav2vec2": lambda: t.Wav2Vec2Model(t.Wav2Vec2Config(
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, **WIDTH)),
    "whisper_encoder": lambda: t.WhisperModel(t.WhisperConfig(
        encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=16)).encoder,
}
IMAGES = {"vit", "clip_vision", "convnext", "swin", "resnet", "segformer"}


def example_input(name: str) -> torch.Tensor:
    if name in IMAGES:
        return torch.randn(2, 3, 32, 32)
    if name == "wav2vec2":
        return torch.randn(2, 400)
    if name == "whisper_encoder":
        return torch.randn(2, 16, 32)
    return torch.randint(0, 1000, (2, 16))


def train_step_matches(name: str) -> bool:
    """One weld-compiled training step against eager's: output and gradients."""
    torch.manual_seed(0)
    model, x = build(name, eager_attention=False).train(), example_input(name)
    if name == "wav2vec2":
        model.config.mask_time_prob = 0.0  # its SpecAugment mask comes from numpy's generator
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, float) and ("drop" in key.lower() or key == "p"):
                setattr(module, key, 0.0)
    results = []
    for run in (torchweld.compile(model), model):
        out = run(x)[0]
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (ours, our_grads), (eager, eager_grads) = results
    return torch.allclose(ours, eager, atol=1e-5) and all(
        _same_grad(g, eager_grads[n]) for n, g in our_grads.items())


def _same_grad(ours: torch.Tensor | None, eager: torch.Tensor | None) -> bool:
    if eager is None:  # a parameter the loss does not reach: zeros through one compiled graph
        return ours is None or not ours.any()
    return ours is not None and torch.allclose(ours, eager, atol=1e-4, rtol=1e-3)


def build(name: str, eager_attention: bool) -> torch.nn.Module:
    model = FAMILIES[name]()
    if eager_attention:
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = "eager"
    return model


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    train = "--train" in sys.argv
    eager_attention = "--eager-attention" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(FAMILIES)
    print(f"torch {torch.__version__}, transformers {t.__version__}, Python {sys.version.split()[0]}")
    print(f"{'family':16s} {'weld graphs':>11s} {'tc graphs':>9s} {'weld capture s':>14s}  matches eager"
          + ("  weld train step matches eager" if train else ""))
    rows = []
    for name in names:
        torch.manual_seed(0)
        row = compare(name, build(name, eager_attention).eval(), example_input(name))
        trained = f"  {train_step_matches(name)}" if train else ""
        if train:
            row["train_step_matches"] = trained.strip() == "True"
        rows.append(row)
        print_row(row, trained)
    report(rows, "families", "transformers_eager_attention" if eager_attention else "transformers")


def first_output(out):
    """The first tensor of a model's output (a tensor, a tuple or a ModelOutput)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def compare(name: str, model: torch.nn.Module, x: torch.Tensor) -> dict:
    """Graphs of torchweld's capture and of torch.compile's for one model, and whether
    torchweld's output equals eager's."""
    with torch.no_grad():
        expected = first_output(model(x))
        ours, theirs = CountingBackend(), CountingBackend()
        start = time.perf_counter()
        out = first_output(torchweld.compile(model, backend=ours)(x))
        seconds = time.perf_counter() - start
        torch._dynamo.reset()
        torch.compile(model, backend=theirs)(x)
        row = {"model": name, "torchweld_graphs": len(ours.graphs), "torch_compile_graphs": len(theirs.graphs),
               "capture_s": round(seconds, 3), "matches_eager": bool(torch.allclose(out, expected, atol=1e-5))}
        if row["torchweld_graphs"] > row["torch_compile_graphs"]:
            reasons = []
            for reason in torchweld.explain(model)(x).break_reasons:
                text = str(reason).splitlines()[0]
                if text not in reasons and len(reasons) < 3:
                    reasons.append(text)
            row["break_reasons"] = reasons
    return row


def print_row(row: dict, extra: str = "") -> None:
    behind = row["torchweld_graphs"] > row["torch_compile_graphs"]
    print(f"{row['model']:28s} {row['torchweld_graphs']:11d} {row['torch_compile_graphs']:9d} {row['capture_s']:14.2f}  "
          f"{row['matches_eager']}{extra}{'  <<<' if behind else ''}")
    for text in row.get("break_reasons", []):
        print(f"    {text[:240]}")


def report(rows: list[dict], kind: str, suite_row: str) -> None:
    """The summary line, and with --record a record of every row in bench/records/capture.jsonl."""
    fewer_or_equal = sum(r["torchweld_graphs"] <= r["torch_compile_graphs"] for r in rows)
    print(f"{fewer_or_equal} of {len(rows)} {kind} in no more graphs than torch.compile's")
    if "--record" in sys.argv:
        from bench import records

        path = records.append("capture", records.make_record("capture", rows, row={"sweep": suite_row}))
        print(f"recorded in {path}")


if __name__ == "__main__":
    main()
