"""LLM decoding: a Llama-style decoder generating one token at a time with a static KV cache
(PyTorch gpt-fast's recipe), eager, torch.compile and torchweld side by side, each compiler in
a fresh process. The per-token step (`decode_step`) is what each compiler compiles, under
`mode="reduce-overhead"` (one CUDA graph a token) unless --mode says otherwise.

    python bench/decode.py --device cuda --batch 1,8                # tokens/s; appends a record
    python bench/decode.py --device cuda --profile torchweld,torch  # + the top kernels of a step
    python bench/decode.py --device cpu --preset tiny --batch 1     # a CPU smoke run

Per compiler and batch it records: ms a token (median of --repeat rounds of --tokens tokens),
tokens/s (batch x tokens a second), the first call's seconds, peak memory, the fraction of the
bandwidth floor reached (weights' bytes + the KV cache's bytes read per step over the GPU's
memory bandwidth, --bandwidth GB/s, 3350 for the H100 SXM), and the largest difference of
the first step's logits from eager's. Records go to bench/records/decode.jsonl.

The model (`Transformer`, --model gpt-fast) is the shape of gpt-fast's: RMSNorm, rotary
positions as a real cos/sin table, grouped-query attention through scaled_dot_product_attention
over the whole cache with a boolean mask row, SwiGLU, the cache written with index_copy_, the
query, key and value projections one weight. --model transformers: transformers'
LlamaForCausalLM of the same shape (separate q/k/v projections, its rotary embedding computed
each step, repeat_kv, its causal mask) generating with its StaticCache (`TransformersDecoder`),
the cache made by an eager step before the compiled ones.

    python bench/decode.py --device cuda --batch 1 --model transformers
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.runner import COMPILERS, apply_tuning_changes, empty_caches, sync, worker_env  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 16
    dim: int = 2048
    heads: int = 32
    kv_heads: int = 8
    hidden: int = 5632
    vocab: int = 32000
    max_seq: int = 2048

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


PRESETS = {
    "0.85b": Shape(),  # ~0.85B parameters, 1.7 GB in bfloat16: the model
    "small": Shape(layers=4, dim=512, heads=8, kv_heads=2, hidden=1536, vocab=8000, max_seq=512),
    "tiny": Shape(layers=2, dim=64, heads=4, kv_heads=2, hidden=128, vocab=97, max_seq=64),
}


# =============================================================================
# The model
# =============================================================================


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class KVCache(nn.Module):
    def __init__(self, batch: int, shape: Shape, dtype):
        super().__init__()
        size = (batch, shape.kv_heads, shape.max_seq, shape.head_dim)
        self.register_buffer("k", torch.zeros(size, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(size, dtype=dtype), persistent=False)

    def update(self, input_pos, k, v):
        """Writes k, v ([B, H, S, D]) at positions input_pos ([S]); returns the whole caches."""
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


def apply_rotary(x, table):
    """x: [B, S, H, D]; table: [S, D/2, 2] of (cos, sin)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    table = table.view(1, pairs.size(1), 1, pairs.size(3), 2)
    out = torch.stack([pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1],
                       pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1]], -1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.shape = shape
        self.wqkv = nn.Linear(shape.dim, (shape.heads + 2 * shape.kv_heads) * shape.head_dim, bias=False)
        self.wo = nn.Linear(shape.dim, shape.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x, table, mask, input_pos):
        s = self.shape
        b, t, _ = x.shape
        kv = s.kv_heads * s.head_dim
        q, k, v = self.wqkv(x).split([s.dim, kv, kv], dim=-1)
        q = apply_rotary(q.view(b, t, s.heads, s.head_dim), table)
        k = apply_rotary(k.view(b, t, s.kv_heads, s.head_dim), table)
        v = v.view(b, t, s.kv_heads, s.head_dim)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        k, v = self.cache.update(input_pos, k, v)
        k = k.repeat_interleave(s.heads // s.kv_heads, dim=1)
        v = v.repeat_interleave(s.heads // s.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(b, t, s.dim))


class FeedForward(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.hidden, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.hidden, bias=False)
        self.w2 = nn.Linear(shape.hidden, shape.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.attention = Attention(shape)
        self.feed_forward = FeedForward(shape)
        self.attention_norm = RMSNorm(shape.dim)
        self.ffn_norm = RMSNorm(shape.dim)

    def forward(self, x, table, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), table, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.dim)
        self.output = nn.Linear(shape.dim, shape.vocab, bias=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(shape.max_seq, shape.max_seq, dtype=torch.bool)),
                             persistent=False)
        self.register_buffer("rotary", rotary_table(shape), persistent=False)

    def setup_caches(self, batch: int) -> None:
        dtype = self.output.weight.dtype
        for layer in self.layers:
            layer.attention.cache = KVCache(batch, self.shape, dtype).to(self.output.weight.device)

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        table = self.rotary[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, table, mask, input_pos)
        return self.output(self.norm(x)).float()


def rotary_table(shape: Shape, base: float = 10000.0):
    freqs = 1.0 / base ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim)
    angles = torch.outer(torch.arange(shape.max_seq).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], -1)


def decode_step(model, token, input_pos):
    """One token for each sequence of the batch: token [B, 1], input_pos [1] -> (next token
    [B, 1] chosen greedily, logits [B, vocab])."""
    logits = model(token, input_pos)[:, -1]
    return logits.argmax(-1, keepdim=True).to(token.dtype), logits


class TransformersDecoder(nn.Module):
    """transformers' LlamaForCausalLM of `shape` with a StaticCache, called as Transformer is:
    (token ids [B, 1], position [1]) -> float logits [B, 1, vocab]."""

    def __init__(self, shape: Shape, device: str, dtype):
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.hidden,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            max_position_embeddings=shape.max_seq, initializer_range=0.02)
        with torch.device(device):
            self.model = transformers.LlamaForCausalLM(config)
        self.model.to(dtype).eval()
        self.cache = transformers.StaticCache(config=config, max_cache_len=shape.max_seq)

    def forward(self, idx, input_pos):
        positions = input_pos[None].expand(idx.shape[0], -1)
        return self.model(input_ids=idx, position_ids=positions, cache_position=input_pos,
                          past_key_values=self.cache, use_cache=True).logits.float()

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))


def build_model(kind: str, shape: Shape, batch: int, device: str, dtype) -> nn.Module:
    """--model's decoder with its caches made for `batch` sequences."""
    if kind == "gpt-fast":
        return build(shape, batch, device, dtype)
    torch.manual_seed(0)
    model = TransformersDecoder(shape, device, dtype)
    with torch.no_grad():  # the StaticCache makes its tensors at its first update: an eager step
        model(torch.zeros(batch, 1, dtype=torch.long, device=device), torch.tensor([0], device=device))
    return model


def build(shape: Shape, batch: int, device: str, dtype) -> Transformer:
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(shape)
        for p in model.parameters():  # small weights: logits stay in a range where bf16 agrees
            nn.init.normal_(p, std=0.02)
    model = model.to(dtype).eval()
    model.rotary = model.rotary.float()
    model.setup_caches(batch)
    return model


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cache_bytes(model: nn.Module) -> int:
    if isinstance(model, TransformersDecoder):
        return model.cache_bytes()
    return sum(b.numel() * b.element_size() for layer in model.layers for b in layer.attention.cache.buffers())


# =============================================================================
# One compiler, in a fresh process
# =============================================================================


def compiled_step(compiler: str, mode: str, weld_options: dict | None = None):
    mode = None if mode == "default" else mode
    if compiler == "eager":
        return decode_step
    if compiler == "torch":
        return torch.compile(decode_step, mode=mode, fullgraph=True)
    import torchweld

    return torchweld.compile(decode_step, backend="weld", mode=mode, fullgraph=True, options=weld_options or None)


def run_worker(job: dict) -> dict:
    device, dtype = job["device"], getattr(torch, job["dtype"])
    shape = PRESETS[job["preset"]]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build_model(job.get("model", "gpt-fast"), shape, job["batch"], device, dtype)
    step = compiled_step(job["compiler"], job["mode"], job.get("weld_options"))
    prompt_len = min(64, shape.max_seq // 4)
    token = torch.randint(0, shape.vocab, (job["batch"], 1), device=device)
    pos = torch.tensor([prompt_len], device=device)

    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(3):  # reduce-overhead records on the third call
            nxt, logits = step(model, token, pos + i)
            if i == 0:
                first_logits = logits.float().cpu().clone()
    sync(device)
    first_s = time.perf_counter() - t0

    def generate(n: int, start: int):
        cur, position = token, torch.tensor([start], device=device)
        with torch.no_grad():
            for _ in range(n):
                nxt, _ = step(model, cur, position)
                cur = nxt.clone()
                position += 1
        return cur

    tokens = job["tokens"]
    rounds = []
    for r in range(job["repeat"]):
        sync(device)
        t = time.perf_counter()
        generate(tokens, prompt_len + 3)
        sync(device)
        rounds.append((time.perf_counter() - t) / tokens * 1e3)
    torch.save(first_logits, job["out"])
    result = {"ms": statistics.median(rounds), "rounds_ms": rounds, "first_s": first_s,
              "weight_bytes": weight_bytes(model), "cache_bytes": cache_bytes(model)}
    if device == "cuda":
        result["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if job.get("profile"):
        result["kernels"] = profile(lambda: generate(job["profile_tokens"], prompt_len + 3), job["profile_tokens"],
                                    device)
    return result


def profile(fn, tokens: int, device: str, top: int = 30) -> list[dict]:
    """The kernels (CUDA) or operators (CPU) of `tokens` steps, most time first: name, calls a
    token, microseconds a token."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        fn()
        sync(device)
    if device == "cuda":
        rows = [(e.key, e.count, e.device_time_total) for e in prof.key_averages()
                if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("aten::")]
    rows.sort(key=lambda r: -r[2])
    return [{"name": name[:120], "per_token": count / tokens, "us_per_token": us / tokens}
            for name, count, us in rows[:top]]


# =============================================================================
# Side by side
# =============================================================================


def spawn(job: dict, workdir: Path) -> dict:
    """`job` in a fresh Python process with empty compiler caches; its result."""
    env = worker_env(empty_caches(str(workdir), f"{job['compiler']}-{job['batch']}"))
    spec = workdir / f"job-{job['compiler']}-{job['batch']}.json"
    spec.write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, __file__, "--worker", str(spec)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="0.85b", choices=sorted(PRESETS))
    parser.add_argument("--model", default="gpt-fast", choices=("gpt-fast", "transformers"))
    parser.add_argument("--weld-options", type=json.loads, default={},
                        help="torchweld's options as JSON, for an A/B ('{\"gated_matvec\": true}')")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--compilers", default=",".join(COMPILERS))
    parser.add_argument("--mode", default="reduce-overhead", choices=("default", "reduce-overhead"))
    parser.add_argument("--tokens", type=int, default=100, help="tokens a timed round")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", default="", help="compilers whose kernels are listed, comma-separated")
    parser.add_argument("--profile-tokens", type=int, default=20)
    parser.add_argument("--bandwidth", type=float, default=3350.0, help="the GPU's memory bandwidth, GB/s")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        apply_tuning_changes()
        job = json.loads(Path(options.worker).read_text())
        print(json.dumps(run_worker(job)))
        return

    from bench import records

    rows = []
    profiled = set(filter(None, options.profile.split(",")))
    with tempfile.TemporaryDirectory(prefix="weld-decode-") as tmp:
        workdir = Path(tmp)
        for batch in (int(b) for b in options.batch.split(",")):
            eager_logits = None
            eager_ms = None
            for compiler in options.compilers.split(","):
                job = {"compiler": compiler, "batch": batch, "device": options.device, "dtype": options.dtype,
                       "preset": options.preset, "model": options.model, "mode": options.mode,
                       "weld_options": options.weld_options,
                       "tokens": options.tokens,
                       "repeat": options.repeat, "profile": compiler in profiled,
                       "profile_tokens": options.profile_tokens, "out": str(workdir / f"{compiler}-{batch}.pt")}
                result = spawn(job, workdir)
                row = {"compiler": compiler, "batch": batch, "mode": options.mode, "preset": options.preset,
                       "model": options.model,
                       "dtype": options.dtype, **result}
                if "error" not in result:
                    logits = torch.load(job["out"])
                    if compiler == "eager":
                        eager_logits, eager_ms = logits, result["ms"]
                    if eager_logits is not None:
                        row["max_diff"] = (logits - eager_logits).abs().max().item()
                        row["speedup"] = eager_ms / result["ms"]
                    row["tokens_per_s"] = batch * 1e3 / result["ms"]
                    floor_ms = (result["weight_bytes"] + result["cache_bytes"]) / (options.bandwidth * 1e9) * 1e3
                    row["floor_ms"] = floor_ms
                    row["of_floor"] = floor_ms / result["ms"]
                rows.append(row)
                report(row)
    if not options.no_record:
        path = records.append("decode", records.make_record("decode", {"rows": rows}, vars(options)))
        print(f"recorded in {path}")


def report(row: dict) -> None:
    if "error" in row:
        print(f"{row['compiler']:9} b{row['batch']}: FAILED\n{row['error']}", flush=True)
        return
    extra = f"  {row['speedup']:.2f}x eager" if "speedup" in row else ""
    diff = f"  max_diff {row['max_diff']:.3g}" if "max_diff" in row else ""
    peak = f"  peak {row['peak_mib']:.0f} MiB" if "peak_mib" in row else ""
    print(f"{row['compiler']:9} b{row['batch']}: {row['ms']:.3f} ms/token  {row['tokens_per_s']:.0f} tokens/s"
          f"{extra}  {row['of_floor']:.0%} of floor ({row['floor_ms']:.3f} ms)  first {row['first_s']:.1f} s"
          f"{peak}{diff}", flush=True)
    for k in row.get("kernels", []):
        print(f"    {k['us_per_token']:8.1f} us  x{k['per_token']:5.1f}  {k['name']}", flush=True)


if __name__ == "__main__":
    main()
