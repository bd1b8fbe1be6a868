"""`pagedvk devices` and `pagedvk bench`, run as a user runs them (a subprocess): usage errors exit 2
with a message naming the option and no traceback."""

import json

import pytest

import pagedvk
import pagedvk.ops.decode_rules
import pagedvk.ops.linear
import pagedvk.ops.prefill
from pagedvk.kernels.matrix import matrix_unavailable

from support import run_python

CLI = "import sys; from pagedvk.cli import main; sys.exit(main(sys.argv[1:]))"


def pagedvk_cli(*argv):
    return run_python(CLI, argv=list(argv))


def test_devices_lists_the_selected_device():
    result = pagedvk_cli("devices")
    assert result.returncode == 0, result.stderr
    assert "selected: [" in result.stdout and pagedvk.devices()[0].name in result.stdout, result.stdout
    # and which prefill kernels each device gets, the reason included
    for info in pagedvk.devices():
        assert f"prefill kernels on [{info.index}]: {pagedvk.ops.prefill.describe_choice(info)}" in result.stdout
        way = "subgroup arithmetic" if pagedvk.ops.decode_rules.subgroup_reductions(info) else "shared memory"
        assert f"decode reductions on [{info.index}]: {way}" in result.stdout
        # lavapipe has the subgroup operations the cpu kernel needs; devices with matrices get the matrix kernel
        kernel = ("cpu (" if info.type == "cpu" else "gpu (" if matrix_unavailable(info)
                  else "coopmat (")
        assert f"decode kernel on [{info.index}]: {kernel}" in result.stdout
        linear = "cpu (" if pagedvk.ops.linear.linear_target(info, "glsl") == "cpu" else "gpu ("
        assert f"linear matrix-vector kernel on [{info.index}]: {linear}" in result.stdout


def test_bench_small_shape_passes_its_check():
    result = pagedvk_cli("bench", "--num-seqs", "2", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "32",
                         "--context", "40", "--iters", "2", "--repeats", "1", "--layers", "1", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout[result.stdout.index("{"):])
    assert figures["rel_error"] < 1e-5 and figures["median_us"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--iters", "0"], "argument --iters: must be an integer of at least 1, got 0"),
    (["--repeats", "0"], "argument --repeats: must be an integer of at least 1"),
    (["--layers", "0"], "argument --layers: must be an integer of at least 1"),
    (["--context", "0"], "argument --context: must be an integer of at least 1"),
    (["--num-seqs", "0"], "argument --num-seqs: must be an integer of at least 1"),
    (["--head-size", "42"], "argument --head-size: must be a multiple of 4 up to 256"),
    (["--num-heads", "7"], "argument --num-heads: must be a multiple of --num-kv-heads"),
    (["--block-size", "12"], "argument --block-size: invalid choice"),
    (["--backend", "metal"], "argument --backend: must be one of glsl, wgsl"),
])
def test_bench_usage_errors(argv, message):
    result = pagedvk_cli("bench", *argv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_bench_help_describes_every_option():
    result = pagedvk_cli("bench", "--help")
    assert result.returncode == 0
    assert "(default: None)" not in result.stdout
    for help_text in ("sequences in the batch", "query heads", "key/value heads", "per head, at most 256",
                      "tokens per cache block", "tokens cached per sequence", "cache dtype (fp8 caches run with float16 queries)"):
        assert help_text in " ".join(result.stdout.split()), help_text


def test_benchmark_shapes_are_parsed_or_refused():
    from pagedvk.testing import bench
    assert bench.parse_shapes("64x4096,8x32768") == [(64, 4096), (8, 32768)]
    for bad in ("64x", "64x4096x2", "0x16", "a,b", ""):
        with pytest.raises(ValueError, match="shapes must be comma-separated BATCHxCONTEXT"):
            bench.parse_shapes(bad)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--json", "/nonexistent/x.json"], "argument --json: cannot write '/nonexistent/x.json': the folder "
                                                  "'/nonexistent' does not exist"),
    (["bench", "--suite", "--small", "--json", "/nonexistent/x.json"], "argument --json: cannot write"),
    (["bench", "--suite", "--small", "--plot", "/nonexistent/x.png"], "argument --plot: cannot write"),
    (["bench", "--json", "/tmp"], "argument --json: '/tmp' is a folder, not a file"),
    (["bench", "--layers", "100000000"], "argument --layers: 100000000 layers of 8 sequences x 1024 tokens"),
    (["bench", "--num-seqs", "10000000000"], "argument --num-seqs/--context: 10000000000 sequences x 1024 tokens"),
    (["bench", "--context", "100000000000"], "argument --num-seqs/--context: 8 sequences x 100000000000 tokens"),
    (["bench", "--suite", "--shapes", "100000000x100000"], "argument --shapes: 100000000 sequences x 100000 tokens"),
    (["demo", "--requests", "-1"], "argument --requests: must be an integer of at least 1, got -1"),
    (["demo", "--block-size", "0"], "argument --block-size: invalid choice: 0"),
    (["demo", "--seed", "-1"], "argument --seed: must be an integer of at least 0, got -1"),
    (["demo", "--heads", "3"], "argument --heads: must be a multiple of --kv-heads (2), got 3"),
    (["demo", "--head-size", "18"], "argument --head-size: must be a multiple of 4 up to 256"),
    (["demo", "--layers", "0"], "argument --layers: must be an integer of at least 1, got 0"),
])
def test_usage_errors_before_any_work(argv, message):
    # Each of these ran (or allocated) first and then ended in a traceback: the whole sweep lost to an unwritable
    # --json, a MemoryError for huge shapes; the demo took -1 requests, said "low >= high" for --block-size 0 and
    # gave numpy's message for --seed -1. Each is a usage error naming the option now, exit code 2, before any
    # work (the sweep would take minutes: these return at once).
    result = pagedvk_cli(*argv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in " ".join(result.stderr.split()) and "Traceback" not in result.stderr, result.stderr
    assert "read bandwidth" not in result.stderr + result.stdout
