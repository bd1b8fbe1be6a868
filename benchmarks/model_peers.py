#!/usr/bin/env python3
"""A Llama-family model's generation on one GPU through pagedvk, llama.cpp's Vulkan build and torch, in one run.

The model is a GGUF file that every peer loads as it is. `--write PATH` makes the issue's benchmark model with gguf's
writer: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query and 8 KV heads of 64, FFN 8192, vocab 32000), float16
random weights, a byte-level vocabulary. Per peer and concurrency B: B prompts of --prompt random token ids are
prefilled together (time to first token: from the call to the first sampled token of every sequence on the host),
then --steps greedy decode steps, each ending with the sampled ids on the host (tokens/s = B * steps / their time).
Each peer runs in a process of its own (its GPU memory freed before the next), after a warm-up generation of the same
batch; EOS is ignored. tokens/s is B over the median step (steady state); the whole run's figure is kept beside it.

Peers, each as its users run it:
  pagedvk   pagedvk.ModelRunner.generate: prefill queued, every decode step one recorded submission replayed.
  llamacpp  llama.cpp's Vulkan backend from `inferna-vulkan` (LlamaModel with every layer on the GPU, one context
            with a unified KV cache for B sequences, one batch per step, llama.cpp's greedy sampler).
  torch     the same forward written here in torch (f16 weights, cuBLAS matmuls, SDPA with enable_gqa=True over a
            contiguous [B, kv heads, context, head] cache), eager: the CUDA anchor.

    python benchmarks/model_peers.py --write /tmp/llama1b.gguf
    python benchmarks/model_peers.py --model /tmp/llama1b.gguf --batches 1,8,32,128 --json out.json
    python benchmarks/model_peers.py --plot out.json --png out.png     # tokens/s against concurrency (matplotlib)
    python benchmarks/model_peers.py --write tiny.gguf --shape tiny     # a model lavapipe runs in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SHAPES = {   # layers, hidden, heads, kv heads, FFN, vocab
    "llama-3.2-1b": (16, 2048, 32, 8, 8192, 32000),
    "tiny": (2, 256, 4, 2, 512, 1024),
}
PEERS = ("pagedvk", "llamacpp", "torch")


# -- the model file ---------------------------------------------------------------------------------------------------

def write_model(path: str, shape: str, seed: int = 0) -> None:
    """A random-weight float16 llama GGUF. Scales as tests/models/tiny_model.py's: unit embedding rows and larger
    layer outputs, so that logits spread and greedy picks are far apart (the peers' tokens can be compared)."""
    import gguf
    from pagedvk.models.tokenizer import byte_tokens
    layers, hidden, heads, kv_heads, ffn, vocab = SHAPES[shape]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = byte_tokens() + ["Ġt"] + [f"w{i}" for i in range(vocab - 257 - len(specials))] + specials
    types = [1] * (vocab - len(specials)) + [3] * len(specials)
    rng = np.random.default_rng(seed)
    head = hidden // heads

    def matrix(rows, cols, scale=None):
        m = rng.standard_normal((rows, cols), dtype=np.float32)
        return (m * (scale if scale is not None else 1 / np.sqrt(cols))).astype(np.float16)

    def norm():
        return (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)
    w.add_tensor("token_embd.weight", matrix(vocab, hidden, 1.0))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", matrix(vocab, hidden, 1.0))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm())
        w.add_tensor(b + "attn_q.weight", matrix(heads * head, hidden))
        w.add_tensor(b + "attn_k.weight", matrix(kv_heads * head, hidden))
        w.add_tensor(b + "attn_v.weight", matrix(kv_heads * head, hidden))
        w.add_tensor(b + "attn_output.weight", matrix(hidden, heads * head, 4 / np.sqrt(heads * head)))
        w.add_tensor(b + "ffn_norm.weight", norm())
        w.add_tensor(b + "ffn_gate.weight", matrix(ffn, hidden))
        w.add_tensor(b + "ffn_up.weight", matrix(ffn, hidden))
        w.add_tensor(b + "ffn_down.weight", matrix(hidden, ffn, 4 / np.sqrt(ffn)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """[batch, length] token ids below the special tokens, the same for every peer."""
    return np.random.default_rng(seed).integers(0, vocab - 3, (batch, length)).astype(np.int32)


def timed(generate_steps, steps: int) -> dict:
    """generate_steps() yields each step's tokens [B] on the host: the first after prefill, then one per decode step.
    Returns ttft, the decode steps' median and total seconds, and every token."""
    t0 = time.perf_counter()
    gen = generate_steps()
    tokens = [next(gen)]
    ttft = time.perf_counter() - t0
    step_times, last = [], time.perf_counter()
    for t in gen:
        now = time.perf_counter()
        step_times.append(now - last)
        last = now
        tokens.append(t)
    assert len(step_times) == steps, (len(step_times), steps)
    return {"ttft_s": ttft, "step_median_s": float(np.median(step_times)), "decode_s": float(sum(step_times)),
            "tokens": np.stack(tokens, 1).tolist()}


# -- the peers, each in its own process -------------------------------------------------------------------------------

def run_pagedvk(args) -> dict:
    import pagedvk
    model = pagedvk.load_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    out = {"peer": "pagedvk", "version": pagedvk.__version__, "backend": args.backend or "glsl"}
    with pagedvk.ModelRunner(model, max_batch=max(batches), max_context=args.prompt + args.steps + 1,
                             backend=args.backend) as runner:
        out["device"] = runner.device.info.name

        def generate(prompts, steps):
            return lambda: runner.generate(list(prompts), steps + 1)
        out["rows"] = run_batches(batches, args, model.config.vocab_size, generate)
    return out


def run_llamacpp(args) -> dict:
    from inferna.llama import llama_cpp as L
    batches = [int(b) for b in args.batches.split(",")]
    L.ggml_backend_load_all()
    mp = L.LlamaModelParams()
    mp.n_gpu_layers = 999
    model = L.LlamaModel(args.model, mp, verbose=False)
    devices = L.ggml_backend_dev_info()
    out = {"peer": "llamacpp", "version": f"inferna-vulkan, llama.cpp {L.llama_version()}, ggml {L.ggml_commit()}",
           "backends": [str(d) for d in devices], "rows": []}
    vocab = model.n_vocab if isinstance(model.n_vocab, int) else model.n_vocab()
    for b in batches:
        cp = L.LlamaContextParams()
        cp.n_ctx = b * (args.prompt + args.steps + 16)
        cp.n_batch = b * args.prompt
        cp.n_ubatch = 512
        cp.n_seq_max = b
        cp.kv_unified = True
        ctx = L.LlamaContext(model, cp, verbose=False)
        sampler = L.LlamaSampler()
        sampler.add_greedy()
        batch = L.LlamaBatch(n_tokens=b * args.prompt, embd=0, n_seq_max=b)

        def generate(prompts, steps):
            def gen():
                ctx.kv_cache_clear()
                batch.clear()
                for s, p in enumerate(prompts):
                    for i, t in enumerate(p):
                        batch.add(int(t), i, [s], i == len(p) - 1)
                if ctx.decode(batch):
                    raise RuntimeError("llama.cpp's decode failed on the prompts")
                last = [(s + 1) * len(p) - 1 for s, p in enumerate(prompts)]
                tokens = np.array([sampler.sample(ctx, i) for i in last], np.int32)
                yield tokens
                for step in range(steps):
                    batch.clear()
                    for s, t in enumerate(tokens):
                        batch.add(int(t), args.prompt + step, [s], True)
                    if ctx.decode(batch):
                        raise RuntimeError("llama.cpp's decode failed")
                    tokens = np.array([sampler.sample(ctx, i) for i in range(len(tokens))], np.int32)
                    yield tokens
            return gen
        out["rows"] += run_batches([b], args, vocab, generate)
        ctx.close()
    return out


def run_torch(args) -> dict:
    import torch
    import torch.nn.functional as F
    from gguf import GGUFReader
    batches = [int(b) for b in args.batches.split(",")]
    reader = GGUFReader(args.model)
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.")}
    layers, heads, kv_heads = meta["llama.block_count"], meta["llama.attention.head_count"], \
        meta["llama.attention.head_count_kv"]
    hidden, eps, theta = meta["llama.embedding_length"], meta["llama.attention.layer_norm_rms_epsilon"], \
        meta["llama.rope.freq_base"]
    d = hidden // heads
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # the CPU only to check the script
    t = {r.name: torch.from_numpy(np.array(r.data).reshape([int(x) for x in reversed(r.shape)])).to(dev)
         for r in reader.tensors}
    t = {k: v.half() if v.ndim == 2 else v.float() for k, v in t.items()}

    def layer(i, name):
        return t[f"blk.{i}.{name}.weight"]
    wqkv = [torch.cat([layer(i, "attn_q"), layer(i, "attn_k"), layer(i, "attn_v")]) for i in range(layers)]
    wgu = [torch.cat([layer(i, "ffn_gate"), layer(i, "ffn_up")]) for i in range(layers)]
    ffn = wgu[0].shape[0] // 2
    max_ctx = args.prompt + args.steps + 1
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
    ang = torch.arange(max_ctx, device=dev, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().half(), ang.sin().half()

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).half()

    def rope(x, pos):            # x [B, n, h, d]; GGUF's llama rotates adjacent pairs (2i, 2i + 1)
        c, s = cos[pos][:, :, None], sin[pos][:, :, None]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)

    @torch.inference_mode()
    def forward(ids, pos, kc, vc, start):   # ids, pos [B, n]; caches [layers, B, kv, ctx, d]
        bsz, n = ids.shape
        x = t["token_embd.weight"][ids]
        for i in range(layers):
            h = rms(x, layer(i, "attn_norm"))
            q, k, v = (h @ wqkv[i].T).split([heads * d, kv_heads * d, kv_heads * d], -1)
            q = rope(q.view(bsz, n, heads, d), pos).transpose(1, 2)
            k = rope(k.view(bsz, n, kv_heads, d), pos).transpose(1, 2)
            kc[i, :, :, start:start + n] = k
            vc[i, :, :, start:start + n] = v.view(bsz, n, kv_heads, d).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, kc[i, :, :, :start + n], vc[i, :, :, :start + n],
                                               is_causal=n > 1, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(bsz, n, heads * d) @ layer(i, "attn_output").T
            gu = rms(x, layer(i, "ffn_norm")) @ wgu[i].T
            x = x + (F.silu(gu[..., :ffn]) * gu[..., ffn:]) @ layer(i, "ffn_down").T
        return (rms(x[:, -1], t["output_norm.weight"]) @ t["output.weight"].T).argmax(-1).int()

    out = {"peer": "torch", "version": torch.__version__,
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "mode": "eager, f16, SDPA enable_gqa=True", "rows": []}

    def generate(prompts, steps):
        def gen():
            b = len(prompts)
            kc = torch.empty((layers, b, kv_heads, max_ctx, d), dtype=torch.half, device=dev)
            vc = torch.empty_like(kc)
            ids = torch.from_numpy(np.asarray(prompts)).to(dev).long()
            pos = torch.arange(args.prompt, device=dev)[None].expand(b, -1)
            tokens = forward(ids, pos, kc, vc, 0)
            yield tokens.cpu().numpy()
            for step in range(steps):
                p = args.prompt + step
                tokens = forward(tokens[:, None].long(), torch.full((b, 1), p, device=dev), kc, vc, p)
                yield tokens.cpu().numpy()
        return gen
    out["rows"] = run_batches(batches, args, t["token_embd.weight"].shape[0], generate)
    return out


def run_batches(batches, args, vocab: int, generate) -> list[dict]:
    """Per concurrency: a warm-up generation of the same batch, then the timed one."""
    rows = []
    for b in batches:
        prompts = prompts_for(b, args.prompt, vocab, args.seed)
        for _ in generate(prompts, min(args.steps, 4))():
            pass
        r = timed(generate(prompts, args.steps), args.steps)
        # Steady-state throughput from the median step, as engines report it; the whole run's too (a step that
        # records or re-plans lands in it)
        r.update(batch=b, tokens_per_s=b / r["step_median_s"], tokens_per_s_whole=b * args.steps / r["decode_s"])
        print(f"  B={b:4d}  ttft {1e3 * r['ttft_s']:8.1f} ms  decode step {1e3 * r['step_median_s']:7.2f} ms  "
              f"{r['tokens_per_s']:9.1f} tokens/s ({r['tokens_per_s_whole']:.1f} over the whole run)",
              file=sys.stderr, flush=True)
        rows.append(r)
    return rows


RUNNERS = {"pagedvk": run_pagedvk, "llamacpp": run_llamacpp, "torch": run_torch}


# -- the driver --------------------------------------------------------------------------------------------------------

def compare(results: list[dict]) -> list[str]:
    """How far each peer's greedy tokens agree with pagedvk's, per batch (random weights: picks are far apart, so the
    peers should agree over the first tokens; float16 rounding may part them later)."""
    lines, base = [], next((r for r in results if r.get("peer") == "pagedvk" and "rows" in r), None)
    if base is None:
        return lines
    for r in results:
        if r is base or "rows" not in r:
            continue
        for mine, theirs in zip(base["rows"], r["rows"]):
            a, b = np.array(mine["tokens"]), np.array(theirs["tokens"])
            same = (a == b).cumprod(1).sum(1)   # leading tokens that agree, per sequence
            lines.append(f"{r['peer']} B={mine['batch']}: leading tokens equal to pagedvk's: median {np.median(same)}"
                         f" of {a.shape[1]}, min {same.min()}")
    return lines


def plot(results: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if "rows" in r:
            ax.plot([x["batch"] for x in r["rows"]], [x["tokens_per_s"] for x in r["rows"]], "o-",
                    label=f"{r['peer']} ({r['version'].split(',')[0]})")
    ax.set(xscale="log", yscale="log", xlabel="concurrent sequences", ylabel="generated tokens/s",
           title="decode throughput, Llama-3.2-1B shape, f16")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", metavar="PATH", help="write the benchmark's GGUF model to PATH and stop")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES), help="the model --write makes")
    p.add_argument("--model", help="the GGUF file the peers run")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--batches", default="1,8,32,128", help="concurrent sequences (default 1,8,32,128)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence (default 128)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="pagedvk's kernels: glsl or wgsl")
    p.add_argument("--json", help="write every figure and token here")
    p.add_argument("--plot", metavar="JSON", help="plot a --json file's tokens/s (needs matplotlib) and stop")
    p.add_argument("--png", default="model_peers.png", help="where --plot writes (default model_peers.png)")
    p.add_argument("--peer", help=argparse.SUPPRESS)   # one peer, in this process (the driver's child)
    args = p.parse_args(argv)
    if args.write:
        write_model(args.write, args.shape)
        print(f"wrote {args.write} ({os.path.getsize(args.write) / 2**30:.2f} GiB)")
        return 0
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f)["results"], args.png)
        print(f"wrote {args.png}")
        return 0
    if not args.model:
        p.error("give --model (make one with --write) or --write or --plot")
    if args.peer:
        json.dump(RUNNERS[args.peer](args), sys.stdout)
        return 0
    results = []
    for peer in args.peers.split(","):
        print(f"{peer}:", file=sys.stderr, flush=True)
        own = argv if argv is not None else sys.argv[1:]
        proc = subprocess.run([sys.executable, __file__, *own, "--peer", peer], stdout=subprocess.PIPE, text=True)
        results.append(json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip()
                       else {"peer": peer, "error": f"exit status {proc.returncode}"})
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
              "prompt": args.prompt, "steps": args.steps, "results": results}
    print("\n" + "\n".join(compare(results)))
    print(f"\n{'B':>5} " + " ".join(f"{r['peer']:>12}" for r in results) + "   (generated tokens/s)")
    for i, b in enumerate(args.batches.split(",")):
        print(f"{b:>5} " + " ".join(f"{r['rows'][i]['tokens_per_s']:12.1f}" if "rows" in r else f"{'-':>12}"
                                    for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
