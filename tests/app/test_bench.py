"""`pagedvk bench --suite` (its JSON record, its plot, its usage errors) and benchmarks/peers.py without torch,
run as a user runs them (a subprocess)."""

import importlib.util
import json

import numpy as np
import pytest

from support import REPO, run_python
from pagedvk.kernels import modules
from pagedvk.testing import bench, suite
from pagedvk.kernels.catalogue import PAGED_DECODE

TINY = [(1, 40), (2, 24)]   # shapes lavapipe times in a second, context not a multiple of the block
SUITE = f"""
import sys
from pagedvk.testing import bench
from pagedvk.cli import main
bench.SMALL_SWEEP = {TINY!r}   # --small, shrunk further for a test
sys.exit(main(sys.argv[1:]))
"""
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
BENCHMARKS = REPO / "benchmarks"


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (they are scripts, not a package), to call its functions in-process."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The full tier: the sweep runs every cache type on both backends in a subprocess (a minute on lavapipe with a cold
# shader cache, a tenth of the default tier's budget); the default tier's bench tests cover its options.
@pytest.mark.full
def test_suite_small_writes_its_record(tmp_path):
    path, png = tmp_path / "suite.json", tmp_path / "suite.png"
    result = run_python(SUITE, argv=["bench", "--suite", "--small", "--iters", "2", "--repeats", "1", "--layers",
                                     "1", "--json", str(path), "--plot", str(png)])
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(path.read_text())
    assert record["device"] and record["driver"] and record["read"]["GBps"] > 0
    assert record["pagedvk"] == __import__("pagedvk").__version__ and "commit" in record
    assert record["command"].startswith("pagedvk bench --suite --small")
    dtypes = list(bench.TOLERANCE)
    assert record["order"] == [f"{b}x{c} {d}" for b, c in TINY for d in dtypes]
    expected = [(b, c, d, backend) for b, c in TINY for d in dtypes for backend in ("glsl", "wgsl")]
    rows = record["rows"]
    assert [(r["num_seqs"], r["context"], r["dtype"], r["backend"]) for r in rows] == expected
    for r in rows:
        assert r["ok"] and r["rel_error"] <= bench.TOLERANCE[r["dtype"]], r
        # GB/s on the cache's own bytes: fp8 counts one byte an element
        own_bytes = 2 * r["num_seqs"] * r["context"] * 8 * 128 * np.dtype(r["dtype"]).itemsize
        assert r["median_us"] > 0 and r["GBps"] == pytest.approx(own_bytes / (r["median_us"] * 1e3))
        assert r["fraction_of_read"] == pytest.approx(r["GBps"] / record["read"]["GBps"])
    assert "| dtype | backend | batch | context | GPU median | GB/s | of read BW |" in result.stdout
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists()
        assert "plot skipped: matplotlib is not installed (pip install pagedvk[bench] adds it)" in result.stdout


def record_of(rows):
    return {"device": "test device", "read": {"GBps": 100.0}, "num_heads": 32, "num_kv_heads": 8, "head_size": 128,
            "block_size": 16, "rows": [{"num_seqs": b, "context": c, "dtype": d, "backend": k, "fraction_of_read": f}
                                       for b, c, d, k, f in rows]}


def test_plot_series_orders_shapes_by_kv_bytes():
    rng = np.random.default_rng(0)
    f = rng.uniform(0.1, 1.0, 5)
    record = record_of([(8, 4096, "float16", "glsl", f[0]), (1, 32768, "float16", "glsl", f[1]),
                        (1, 4096, "float16", "wgsl", f[2]), (1, 4096, "float16", "glsl", f[3]),
                        (64, 4096, "float8_e5m2", "glsl", f[4])])
    series = suite.plot_series(record)
    shapes = ["1x4096", "8x4096", "1x32768", "64x4096"]   # equal bytes: the shorter context first
    assert series == {
        "float16": {"shapes": shapes, "lines": {"glsl": [100 * f[3], 100 * f[0], 100 * f[1], None],
                                                "wgsl": [100 * f[2], None, None, None]}},
        "float8_e5m2": {"shapes": shapes, "lines": {"glsl": [None, None, None, 100 * f[4]]}}}


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install pagedvk[bench]); "
                                               "the suite's JSON is tested without it")
def test_plot_writes_a_png(tmp_path):
    record = record_of([(1, 4096, d, k, 0.5) for d in ("float32", "float16") for k in ("glsl", "wgsl")]
                       + [(8, 4096, "float32", "glsl", 0.25)])
    assert suite.plot(record, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dtypes_and_backends_are_parsed_or_refused():
    assert bench.parse_dtypes("f16,bfloat16,e4m3") == ["float16", "bfloat16", "float8_e4m3fn"]
    assert bench.parse_backends("wgsl,GLSL") == ["wgsl", "glsl"]
    for bad in ("f64", "f16,", "", "fp8"):
        with pytest.raises(ValueError, match="dtypes must be comma-separated names from f32, f16"):
            bench.parse_dtypes(bad)
    for bad in ("metal", "glsl,", ""):
        with pytest.raises(ValueError, match="backends must be comma-separated names from glsl, wgsl"):
            bench.parse_backends(bad)


@pytest.mark.parametrize("argv, message", [
    (["--suite", "--context", "64"], "argument --context: not allowed with --suite"),
    (["--suite", "--num-seqs", "2"], "argument --num-seqs: not allowed with --suite"),
    (["--suite", "--dtype", "float16"], "argument --dtype: not allowed with --suite"),
    (["--suite", "--backend", "wgsl"], "argument --backend: not allowed with --suite"),
    (["--shapes", "1x16"], "argument --shapes: not allowed without --suite"),
    (["--small"], "argument --small: not allowed without --suite"),
    (["--dtypes", "f16"], "argument --dtypes: not allowed without --suite"),
    (["--plot", "x.png"], "argument --plot: not allowed without --suite"),
    (["--suite", "--small", "--shapes", "1x16"], "argument --shapes: not allowed with argument --small"),
    (["--suite", "--shapes", "4x"], "argument --shapes: shapes must be comma-separated BATCHxCONTEXT"),
    (["--suite", "--dtypes", "f16,f64"], "argument --dtypes: dtypes must be comma-separated names from"),
    (["--suite", "--backends", "glsl,metal"], "argument --backends: backends must be comma-separated names"),
    (["--suite", "--head-size", "36", "--dtypes", "f16"],
     "argument --head-size: must be a multiple of 8 up to 256 for float16"),
    (["--suite", "--head-size", "40"], "argument --head-size: must be a multiple of 16 up to 256 for float8"),
])
def test_suite_usage_errors(argv, message):
    result = run_python(SUITE, argv=["bench", *argv])
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_single_shape_json_path_is_written(tmp_path):
    path = tmp_path / "one.json"
    result = run_python(SUITE, argv=["bench", "--num-seqs", "2", "--num-heads", "4", "--num-kv-heads", "2",
                                     "--head-size", "32", "--context", "40", "--iters", "2", "--repeats", "1",
                                     "--layers", "1", "--json", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(path.read_text())
    assert figures["ok"] and figures["rel_error"] < 1e-5 and figures["num_seqs"] == 2 and figures["context"] == 40
    assert "KV bandwidth" in result.stdout   # the text summary still printed


def test_peers_without_torch_prints_pagedvk_figures(tmp_path):
    peers = BENCHMARKS / "peers.py"
    # torch made unimportable, whether or not it is installed here
    code = (f"import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = {str(peers)!r}; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    path = tmp_path / "peers.json"
    result = run_python(code, argv=["--shapes", "2x24", "--dtypes", "f16,e5m2", "--iters", "2", "--repeats", "1",
                                    "--json", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no torch peers: torch is not installed; pagedvk's figures alone" in result.stdout
    for dtype in ("float16", "float8_e5m2"):
        assert f"| {dtype} | 2 | 24 |" in result.stdout and "| - | - | - |" in result.stdout
    record = json.loads(path.read_text())
    assert [(r["dtype"], r["backend"]) for r in record["rows"]] == [
        ("float16", "glsl"), ("float16", "wgsl"), ("float8_e5m2", "glsl"), ("float8_e5m2", "wgsl")]
    assert all(r["ok"] for r in record["rows"]) and "peers" not in record


def test_peers_no_torch_leaves_torch_out(tmp_path):
    # torch left out by choice (the GLSL-WGSL comparisons of the device kits), whether or not it is installed
    peers = BENCHMARKS / "peers.py"
    code = f"import runpy, sys; sys.argv[0] = {str(peers)!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    result = run_python(code, argv=["--shapes", "2x24", "--dtypes", "bf16", "--backends", "wgsl", "--iters", "2",
                                    "--repeats", "1", "--no-torch"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no torch peers: --no-torch given; pagedvk's figures alone" in result.stdout
    assert "| bfloat16 | 2 | 24 |" in result.stdout


def run_prefill_bench(sweep: dict, argv: list):
    """benchmarks/prefill.py run with torch hidden and its small sweep replaced by `sweep`."""
    script = BENCHMARKS / "prefill.py"
    code = (f"import importlib.util, sys; sys.modules['torch'] = None; "
            f"spec = importlib.util.spec_from_file_location('prefill_bench', {str(script)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            f"m.SMALL_SWEEP = {sweep!r}; sys.exit(m.main(sys.argv[1:]))")
    return run_python(code, argv=argv)


def test_prefill_benchmark_small_without_torch(tmp_path):
    # benchmarks/prefill.py --small on a tiny mixed batch (a prompt chunk, a decode token, an empty sequence):
    # forward, backward and the parts as separate calls, each checked and written to the JSON record.
    path = tmp_path / "prefill.json"
    # --kernels auto,coopmat: float32 has no matrix module, so coopmat's rows are reported skipped, with why.
    result = run_prefill_bench({'mixed': [(5, 20), (1, 24), (0, 9)]},
                               ["--small", "--dtypes", "f32", "--repeats", "1", "--kernels", "auto,coopmat",
                                "--json", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no torch with CUDA: pagedvk's figures alone" in result.stdout
    assert result.stdout.count("coopmat: skipped: kernel='coopmat' cannot run") == 2, result.stdout
    rows = json.loads(path.read_text())["rows"]
    assert [(r["backend"], r["kernel"]) for r in rows] == [("glsl", "auto"), ("wgsl", "auto")]
    for r in rows:
        assert r["ok"] and r["forward_us"] > 0 and r["backward_us"] > 0 and r["separate_us"] > 0
        assert r["GFLOP"] == 4 * 64 * 4 * (5 * 15 + 15 + 24) / 1e9   # (query head, visible key) pairs


def test_prefill_benchmark_forward_only(tmp_path):
    # --forward-only: the forward's figures alone, checked against float64 as ever; no backward in the record.
    path = tmp_path / "prefill.json"
    result = run_prefill_bench({'two': [(5, 20), (3, 9)]},
                               ["--small", "--dtypes", "f16", "--repeats", "1", "--forward-only", "--json", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(path.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["glsl", "wgsl"]
    for r in rows:
        assert r["ok"] and r["forward_us"] > 0 and "backward_us" not in r


def test_coopmat_probe_builds_every_mode_and_times_what_the_device_runs(tmp_path):
    # benchmarks/coopmat_probe.py: every mode's module compiles and passes spirv-val; the device times the modes it
    # runs (lavapipe: the float32 one) and the record names them.
    module = load_benchmark("coopmat_probe")
    for mode in module.MODES:
        assert module.build(mode, tmp_path)[:4] == b"\x03\x02\x23\x07"   # the SPIR-V magic number
    out = tmp_path / "probe.json"
    assert module.main(["--iters", "8", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows[0]["mode"] == "FMA" and rows[0]["ns"] > 0 and rows[0]["TFLOPs"] > 0
    # The LAYOUT mode's reference, PTX's mma.m16n8k16 fragments: the 32 invocations hold every element once.
    for name, (cols, fragment) in module.MMA_FRAGMENTS.items():
        count = 16 * cols // 32
        held = sorted(fragment(lane, e) for lane in range(32) for e in range(count))
        assert held == [(r, c) for r in range(16) for c in range(cols)], name


@pytest.mark.parametrize("chunks, groups", [(16, 1), (2048, 1), (2048 * 3 + 700, 2), (2048 * 5 + 1, 3), (999, 4)])
def test_the_read_kernel_reads_every_chunk_once(chunks, groups):
    """The ceiling's kernel (shaders/read_bandwidth.comp) reads each of num_chunks 16-byte chunks exactly once and
    nothing past them: the XOR of its threads' words equals the XOR of the chunks' words (a chunk read twice
    would cancel, one skipped would be missing), with a poisoned chunk after them in the buffer."""
    from pagedvk.runtime.array import asarray, empty
    from pagedvk.runtime.pipeline import Launch
    from pagedvk.runtime.selection import get_device

    device = get_device()
    words = np.random.default_rng(chunks).integers(0, 2**32, size=4 * (chunks + 1), dtype=np.uint32)
    src = asarray(words)
    dst = empty((groups * 256,), np.uint32)
    launch = Launch(device, [bench.read_step(device, src, dst, 16 * chunks, workgroups=groups)])   # the ceiling's step
    try:
        launch.submit()
        got = np.bitwise_xor.reduce(dst.numpy())
    finally:
        launch.close()
        src.close()
        dst.close()
    assert got == np.bitwise_xor.reduce(words[:4 * chunks])


def test_decode_rules_pins_a_rule_and_puts_it_back(tmp_path, capsys):
    # benchmarks/decode_rules.py: each answer's plans run and are checked against float64, the rule's own function is
    # back in pagedvk.ops.decode_rules afterwards, and an answer the rule does not have is refused, named.
    rules = load_benchmark("decode_rules")
    import pagedvk.ops.decode_rules
    own = pagedvk.ops.decode_rules.values_with_keys
    path = tmp_path / "rules.json"
    assert rules.main(["values_with_keys", "--shapes", "1x200", "--dtypes", "f16", "--kernel", "gpu", "--iters", "2",
                       "--rounds", "1", "--json", str(path)]) == 0
    assert pagedvk.ops.decode_rules.values_with_keys is own
    rows = json.loads(path.read_text())["rows"]
    assert [r["answer"] for r in rows] == ["rule", "never", "always"]
    assert all(r["ok"] and r["kernel"] == "gpu" and r["median_us"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        rules.main(["values_with_keys", "--answers", "rule,3"])
    assert "answers of values_with_keys are rule, never, always; got 3" in capsys.readouterr().err


def test_floors_times_an_empty_dispatch_and_each_read(tmp_path):
    # benchmarks/floors.py on lavapipe, two small sizes: the empty dispatch, and each size's read alone and followed
    # by an empty dispatch, in the JSON record.
    floors = load_benchmark("floors")
    path = tmp_path / "floors.json"
    assert floors.main(["--sizes-mib", "1,8", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["device"] and record["empty dispatch"]["median_us"] > 0
    for nbytes in (1 << 20, 8 << 20):
        row = record[f"{nbytes} bytes"]
        assert row["read"]["median_us"] > 0 and row["read then an empty dispatch"]["median_us"] > 0
        assert row["GBps"] == pytest.approx(nbytes / (row["read"]["median_us"] * 1e3))


@pytest.mark.parametrize("sizes", ["", "abc", "16,x", "0", "-4", "0.000001"])
def test_floors_refuses_sizes_it_cannot_read(sizes, capsys):
    floors = load_benchmark("floors")
    with pytest.raises(SystemExit):
        floors.main(["--sizes-mib", sizes])
    assert f"--sizes-mib must be comma-separated positive sizes in MiB, got {sizes!r}" in capsys.readouterr().err


def test_decode_ablations_swap_the_module_the_plan_runs(tmp_path):
    # benchmarks/decode_ablations.py on the scalar kernel: the kept kernel matches float64, an ablation's result does
    # not (its module took the plan's pipeline, under the plan's own specialization), and the plans after it build
    # the real module again.
    ablations = load_benchmark("decode_ablations")
    path = tmp_path / "ablations.json"
    assert ablations.main(["--kernel", "gpu", "--shapes", "2x200", "--iters", "2", "--only", "no key loads",
                           "--json", str(path)]) == 0
    rows = {r["ablation"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == ["kept kernel", "no key loads", "kept kernel, identity block tables"]
    assert rows["kept kernel"]["ok"] and rows["kept kernel, identity block tables"]["ok"]
    assert rows["no key loads"]["swapped"] and rows["no key loads"]["rel_error"] > 0.1
    assert all(r["module"] == "paged_decode.kv_f16.glsl" and r["kernel"] == "gpu" for r in rows.values())
    with bench.DecodeInputs(bench.DecodeShape(num_seqs=2, context=200, dtype="float16")) as inputs:
        assert bench.time_decode(inputs, "glsl", iters=2, repeats=1, kernel="gpu")["ok"]


@pytest.mark.parametrize("module", [("f16", "f16", ""), ("f16", "f16", "coopmat"), ("bf16", "bf16", "coopmat"),
                                    ("e4m3", "f16", "coopmat")], ids=lambda m: f"{m[2] or 'scalar'}-{m[0]}")
def test_every_decode_ablation_builds(module, tmp_path):
    # Each ablation's statements are still in its kernel's source, and the edited source compiles and validates
    # as the module (a kernel edit that moves a statement breaks the script here, not on the next device run).
    ablations = load_benchmark("decode_ablations")
    kv, q, matrix = module
    key = PAGED_DECODE.key("glsl", kv, q, 128, matrix=matrix)
    assert key.source == ablations.KERNELS["coopmat" if matrix else "gpu"]
    names = list(ablations.ablations_for(key))
    built = ablations.build(key, names, tmp_path / "built")
    assert list(built) == ["kept kernel", *names]
    outputs = {(folder / f"{key.name}.spv").read_bytes() for folder in built.values()}
    assert len(outputs) == len(built)   # every ablation changed the module


def test_decode_ablations_refuse_what_they_cannot_run(capsys):
    ablations = load_benchmark("decode_ablations")
    with pytest.raises(SystemExit):
        ablations.main(["--kernel", "gpu", "--shapes", "1x64", "--iters", "1", "--only", "no such stage"])
    assert "--only: paged_decode.kv_f16.glsl has no ablation 'no such stage'" in capsys.readouterr().err
    import pagedvk
    from pagedvk.kernels.matrix import matrix_unavailable
    why = matrix_unavailable(pagedvk.select()[0], pagedvk.default_device().features)
    if why:   # a device without the matrix decode (lavapipe): refused, with the plan's reason
        with pytest.raises(SystemExit):
            ablations.main(["--kernel", "coopmat", "--shapes", "1x64", "--iters", "1"])
        assert "--kernel coopmat cannot run here: " in capsys.readouterr().err


def test_large_cache_checks_a_decode_over_its_cache(capsys):
    # benchmarks/large_cache.py at 16 MiB a cache (the H200 run takes 24 GiB): decode over 64 scattered blocks, the
    # last one included, against float64; a size it cannot allocate is refused by name.
    large = load_benchmark("large_cache")
    assert large.main(["0.015625"]) == 0
    assert "rel. error" in capsys.readouterr().out
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit):
            large.main([bad])
    assert "gib" in capsys.readouterr().err


def test_host_overhead_reports_issue_9s_host_rows(capsys):
    # benchmarks/host_overhead.py, short: run() on device arrays, the Python-only path, and the one-shot call, each
    # with wall time, GPU time and their difference.
    host = load_benchmark("host_overhead")
    assert host.main(["--context", "64", "--oneshot-context", "16", "--iters", "5"]) == 0
    out = capsys.readouterr().out
    for row in ("run 1x64 ", "run, Python only", "one-shot 1x16 "):
        assert row in out
    assert out.count("wall - GPU") == 2


def test_decode_ab_runs_each_sets_modules_in_turn(tmp_path, capsys):
    # benchmarks/decode_ab.py: a set whose folder holds a broken decode module (an ablation's: keys never loaded)
    # gives wrong results in its rounds only; the package's modules, in the rounds between, stay right.
    ab, ablations = load_benchmark("decode_ab"), load_benchmark("decode_ablations")
    key = PAGED_DECODE.key("glsl", "f16", "f16", 128)
    broken = ablations.build(key, ["no key loads"], tmp_path / "built")["no key loads"]   # a folder of that module
    path = tmp_path / "ab.json"
    assert ab.main([f"main={modules.SPV_DIR}", f"broken={broken}", "--shapes", "2x200", "--kernel", "gpu",
                    "--rounds", "2", "--iters", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["set"] for r in rows] == ["main", "broken", "main", "broken"]
    assert [r["ok"] for r in rows] == [True, False, True, False]
    # each row says which modules its set served: the broken folder holds the decode module alone, so the merge's
    # (if the plan splits) came from the package, and the decode itself never did
    for r in rows:
        assert key.name in r["modules_from_set"], r
        assert key.name not in r["modules_from_package"], r
    # the closing table: each set's best round against the first set's
    out = capsys.readouterr().out
    best = {name: min(r["median_us"] for r in rows if r["set"] == name) for name in ("main", "broken")}
    change = 100 * (best["broken"] / best["main"] - 1)
    assert "| dtype | batch x context | main | broken |" in out
    assert f"| float16 | 2 x 200 | {best['main']:.2f} us | {best['broken']:.2f} us ({change:+.1f}%) |" in out


@pytest.mark.parametrize("sets, message", [
    (["{spv}", "b={spv}"], "a set is NAME=DIR, got '{spv}'"),
    (["a={spv}", "b=/nonexistent"], "set b: /nonexistent is not a folder of SPIR-V modules"),
    (["a={spv}", "a={spv}"], "sets need distinct names")])
def test_decode_ab_refuses_sets_it_cannot_use(sets, message, capsys):
    # {spv}: the package's own modules (pagedvk/spv in a checkout, the installed package's elsewhere)
    ab = load_benchmark("decode_ab")
    with pytest.raises(SystemExit):
        ab.main([s.format(spv=modules.SPV_DIR) for s in sets] + ["--shapes", "1x64"])
    assert message.format(spv=modules.SPV_DIR) in capsys.readouterr().err


def test_queue_probe_restores_the_stream_and_barriers(capsys, tmp_path):
    # benchmarks/queue_probe.py, short: every row printed, and what it changed for its rows put back after.
    from pagedvk.runtime import commands
    from pagedvk.runtime.stream import Stream
    import pagedvk.config
    barrier, in_flight, batch = commands.memory_barrier, Stream.IN_FLIGHT, pagedvk.config.batch()
    probe = load_benchmark("queue_probe")
    assert probe.main(["--layers", "2", "--batch", "1", "--context", "32", "--steps", "2", "--warm", "0",
                       "--json", str(tmp_path / "probe.json")]) == 0
    printed = capsys.readouterr().out
    figures = json.loads((tmp_path / "probe.json").read_text())
    for row in ("gpu_us", "replay_us", "queued_inflight2_us", "one_submit_us", "light_one_submit_us"):
        assert figures[row] > 0 and f"\n{row} " in printed
    assert commands.memory_barrier is barrier and Stream.IN_FLIGHT == in_flight
    assert pagedvk.config.batch() == batch   # PAGEDVK_BATCH as it was


def test_step_benchmark_reports_issue_38s_rows(capsys, tmp_path):
    # benchmarks/step.py, short: a recorded step, the same ops queued one by one and fused, and the wait's CPU share.
    step = load_benchmark("step")
    assert step.main(["--layers", "2", "--batch", "1", "--context", "32", "--heads", "4", "--kv-heads", "2",
                      "--head-size", "64", "--steps", "2", "--wait-steps", "2", "--warm", "0",
                      "--json", str(tmp_path / "step.json")]) == 0
    printed = capsys.readouterr().out
    for row in ("GPU", "replayed", "queued", "fused", "waiting"):
        assert f"\n{row} " in printed
    import json
    figures = json.loads((tmp_path / "step.json").read_text())
    assert figures["gpu_us"] > 0 and figures["replay_wall_us"] > 0 and 0 <= figures["wait_cpu_share"] <= 1


def test_streams_benchmark_runs(capsys):
    streams = load_benchmark("streams")
    assert streams.main(["--context", "64", "--repeats", "2"]) == 0
    assert "overlap" in capsys.readouterr().out


def test_layer_ops_host_cost_prints_every_op(capsys):
    assert load_benchmark("layer_ops_host").main(["--iters", "3"]) == 0
    text = capsys.readouterr().out
    for op in ("embedding", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"):
        assert f"| {op} | " in text


def test_linear_benchmark_small(tmp_path, capsys):
    # benchmarks/linear.py --small: each shape checked against float64, timed, and compared with the read kernel.
    linear = load_benchmark("linear")
    assert linear.main(["--small", "--iters", "2", "--tokens", "1,9", "--json", str(tmp_path / "linear.json")]) == 0
    printed = capsys.readouterr().out
    assert "| 96 | 300 | 9 | gemm |" in printed and "of read" in printed
    import json
    rows = json.loads((tmp_path / "linear.json").read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["gemv", "gemm"] * 2 and all(r["median_us"] > 0 for r in rows)
