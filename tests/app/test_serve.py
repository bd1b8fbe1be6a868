"""The demo's model and continuous batching: tokens served over the block-managed paged cache (prefix hits,
forks with copy-on-write, swap preemption) equal independent dense float64 runs, and a cache that skips a
copy is caught."""

import numpy as np
import pytest

from pagedvk.testing import reference
from pagedvk.demo.model import DenseKV, Model, ModelConfig, generate_dense
from pagedvk.demo.serve import NumpyPagedCache, Request, make_requests, serve

CONFIG = ModelConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_size=8, intermediate=48, seed=3)


def dense_outputs(model, requests):
    return {(r.id, b): generate_dense(model, r.prompt, r.max_new, b) for r in requests for b in range(r.n)}


@pytest.fixture(scope="module")
def stream():
    model = Model(CONFIG)
    reqs = make_requests(16, CONFIG.vocab, block_size=4, seed=5, steps=8)
    return model, reqs, dense_outputs(model, reqs)


def test_stream_equals_dense_reference(stream):
    model, reqs, dense = stream
    report = serve(model, reqs, num_blocks=28, block_size=4, num_host_blocks=200)
    s = report.manager_stats
    # the stream must exercise every mechanism, or equality proves little
    assert report.preemptions > 0 and s["swapped_in_blocks"] > 0
    assert s["forks"] > 0 and s["cow_copies"] > 0 and s["prefix_hit_blocks"] > 0
    assert report.outputs == dense
    assert report.generated == sum(r.n * r.max_new for r in reqs)


@pytest.mark.parametrize("broken", ["copy_blocks", "swap"])
def test_a_skipped_cache_copy_changes_tokens(stream, broken):
    model, reqs, dense = stream

    class Broken(NumpyPagedCache):
        pass
    setattr(Broken, broken, lambda self, *a, **k: None)
    cache = Broken(CONFIG.layers, CONFIG.kv_heads, CONFIG.head_size, 28, 4, 200)
    report = serve(model, reqs, num_blocks=28, block_size=4, num_host_blocks=200, cache=cache)
    assert report.outputs != dense


def test_too_few_blocks_for_one_prompt_names_num_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        serve(Model(CONFIG), [Request(0, list(range(20)))], num_blocks=2, block_size=4)


def test_incremental_dense_equals_one_pass():
    model, rng = Model(CONFIG), np.random.default_rng(0)
    toks = rng.integers(0, CONFIG.vocab, 11)
    full = model.forward(toks, np.arange(11), DenseKV(CONFIG.layers))
    kv = DenseKV(CONFIG.layers)
    step = np.concatenate([model.forward(toks[:6], np.arange(6), kv)]
                          + [model.forward(toks[i:i + 1], [i], kv) for i in range(6, 11)])
    assert np.abs(step - full).max() <= 1e-12 * np.abs(full).max()


def test_rope_is_a_rotation_by_relative_position():
    model, rng = Model(CONFIG), np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 1, CONFIG.head_size))
    dots = [float((model.rope(q, np.array([p + 3])) * model.rope(k, np.array([p]))).sum()) for p in (0, 7)]
    assert abs(dots[0] - dots[1]) < 1e-12 and abs(dots[0] - float((q * k).sum())) > 1e-6


def test_numpy_cache_write_matches_gather_and_skips_padding():
    rng = np.random.default_rng(2)
    cache = NumpyPagedCache(1, 2, 8, num_blocks=4, block_size=4, num_host_blocks=0)
    k, v = rng.standard_normal((2, 5, 2, 8))
    slots = np.array([9, 10, -1, 11, 12], np.int32)
    cache.write(0, k, v, slots)
    gk, gv = reference.gather_kv(cache.key[0], cache.value[0], [3, 2, 3], 9)  # tokens 4..8 at blocks 2, 3
    keep = slots >= 0
    np.testing.assert_array_equal(gk[5:9], k[keep])
    np.testing.assert_array_equal(gv[5:9], v[keep])
    assert np.isnan(cache.key[0][0]).all() and np.isnan(cache.key[0][1]).all()


@pytest.mark.parametrize("field, value", [("heads", 0), ("kv_heads", 3), ("head_size", 7), ("vocab", 1.5)])
def test_model_config_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{field: value})


def test_forward_rejects_out_of_vocab_tokens():
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 64\)"):
        Model(CONFIG).forward([64], [0], DenseKV(CONFIG.layers))


def test_cli_demo_checks_against_the_dense_reference(capsys):
    from pagedvk.cli import main
    assert main(["demo", "--requests", "6", "--num-blocks", "16", "--block-size", "8", "--check"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "preemptions" in out and "equal the dense reference" in out
