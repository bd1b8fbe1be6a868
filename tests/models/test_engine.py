"""pagedvk.models.engine: continuous batching over the runner's device forward. Every request's greedy tokens, served
beside others (different prompt lengths, arrivals mid-generation, chunked prompts, n > 1, prefix hits, swapping),
equal the float64 reference's for that request alone; seeded draws do not depend on the batch; bad requests are
refused by name and change nothing."""

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import tiny_model  # noqa: E402

import pagedvk  # noqa: E402
from pagedvk.models import reference  # noqa: E402
from pagedvk.models.engine import LLMEngine  # noqa: E402
from pagedvk.models.params import SamplingParams  # noqa: E402

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the loaded model, the Model its file holds): a float16 llama, context 64."""
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    want = tiny_model.write(path)
    return pagedvk.load_model(path), want


def runner(model, **options):
    return pagedvk.ModelRunner(model, **{"max_batch": 4, "block_size": 8, **options})


def serve(engine, arrivals):
    """Step the engine until every request is done; arrivals: {step: [(id, prompt, SamplingParams)]}, each added
    before that step. Returns ({id: [tokens of sample 0, of sample 1, ...]}, {id: [finish reasons]}, the steps'
    outputs)."""
    tokens, reasons, steps, step = {}, {}, [], 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
            tokens[request_id] = [[] for _ in range(params.n)]
            reasons[request_id] = [None] * params.n
        outs = engine.step()
        steps.append(outs)
        for out in outs:
            for s in out.outputs:
                assert reasons[out.request_id][s.index] is None, "a finished sample produced a token"
                tokens[out.request_id][s.index] += s.new_token_ids
                reasons[out.request_id][s.index] = s.finish_reason
            assert out.finished == all(r is not None for r in reasons[out.request_id])
        step += 1
    return tokens, reasons, steps


def greedy(want, prompt, n):
    return reference.greedy(want, prompt, n, np.float16)


def test_a_stream_of_requests_gives_each_its_greedy_tokens_alone(tiny):
    model, want = tiny
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, 256, 17)]          # two full blocks of 8 and one token
    prompt = lambda n: [int(t) for t in rng.integers(0, 256, n)]
    arrivals = {
        0: [("long", shared + prompt(6), SamplingParams(max_tokens=20, **GREEDY)),
            ("short", prompt(3), SamplingParams(max_tokens=30, **GREEDY))],
        1: [("prefix", shared + prompt(4), SamplingParams(max_tokens=8, **GREEDY))],   # long's first two blocks
        2: [("pair", prompt(11), SamplingParams(max_tokens=12, n=2, **GREEDY))],
        5: [("late", prompt(30), SamplingParams(max_tokens=6, **GREEDY))],
        9: [("last", prompt(2), SamplingParams(max_tokens=10, **GREEDY))],
    }
    # 9 blocks of 8 tokens hold fewer than these requests at once: some are swapped out and back in. A budget of
    # 6 tokens a step cuts every prompt but the shortest into chunks.
    with runner(model, num_blocks=9, num_host_blocks=32) as r:
        engine = LLMEngine(r, max_num_batched_tokens=6)
        tokens, reasons, steps = serve(engine, arrivals)
        stats, blocks = engine.stats, r.cache.blocks.stats
        assert r.cache.blocks.num_free_blocks == 9 and not r.cache.blocks.seqs   # everything freed
    for request_id, prompt_, params in (a for group in arrivals.values() for a in group):
        expected = greedy(want, prompt_, params.max_tokens)
        assert tokens[request_id] == [expected] * params.n, request_id
        assert reasons[request_id] == ["length"] * params.n
    # every mechanism ran, or the equality proves little
    assert stats["preemptions"] > 0 and blocks["swapped_out_blocks"] > 0 and blocks["swapped_in_blocks"] > 0
    assert blocks["prefix_hit_blocks"] == 2 and stats["cached_prompt_tokens"] == 16
    assert blocks["forks"] == 1 and blocks["cow_copies"] >= 1
    assert stats["recorded_steps"] > 0 and stats["recorded_steps"] < stats["steps"]
    late_first = next(i for i, outs in enumerate(steps) if any(o.request_id == "late" for o in outs))
    assert late_first >= 5 + 30 // 6 - 1   # its 30 prompt tokens took at least five steps of 6


def test_prefix_hit_reports_the_cached_tokens(tiny):
    model, want = tiny
    prompt = list(range(40, 60))                                   # 20 tokens: two full blocks of 8
    with runner(model) as r:
        engine = LLMEngine(r)
        first, _, _ = serve(engine, {0: [("a", prompt, SamplingParams(max_tokens=3, **GREEDY))]})
        engine.add_request("b", prompt + [7], SamplingParams(max_tokens=3, **GREEDY))
        out = engine.step()[0]
        assert out.num_cached_tokens == 16 and engine.stats["cached_prompt_tokens"] == 16
    assert first["a"][0] == greedy(want, prompt, 3)
    assert out.outputs[0].new_token_ids == greedy(want, prompt + [7], 1)


def test_a_decode_step_replays_the_step_recorded_for_its_batch_size(tiny):
    model, _ = tiny
    with runner(model) as r:
        engine = LLMEngine(r)
        engine.add_request(0, [1, 2, 3], SamplingParams(max_tokens=6, **GREEDY))
        engine.add_request(1, [4, 5], SamplingParams(max_tokens=3, **GREEDY))
        seen = []                                                  # (rows, the step replayed)
        while engine.has_unfinished_requests():
            rows = sum(len(o.outputs) for o in engine.step())
            seen.append((rows, r.decode_step))
        assert seen[0][1] is None                                   # the prompts: a ragged step
        two, one = {id(s) for n, s in seen[1:] if n == 2}, {id(s) for n, s in seen[1:] if n == 1}
        assert len(two) == 1 and len(one) == 1 and two != one       # one recording per batch size, replayed
        kept = r.decode_step
        engine.add_request(2, [9], SamplingParams(max_tokens=2, **GREEDY))
        engine.step()
        engine.step()
        assert r.decode_step is kept                                # kept across requests


def test_seeded_draws_do_not_depend_on_the_batch(tiny):
    model, _ = tiny
    # The tiny model's logits lie far apart (tiny_model.write): a high temperature makes its draws differ.
    sampled = SamplingParams(max_tokens=8, temperature=8.0, top_p=0.95, seed=11, n=2)
    with runner(model) as r:
        alone, _, _ = serve(LLMEngine(r), {0: [("s", [3, 1, 4, 1, 5], sampled)]})
        crowd, _, _ = serve(LLMEngine(r), {0: [("x", [2, 7], SamplingParams(max_tokens=9, **GREEDY))],
                                           1: [("s", [3, 1, 4, 1, 5], sampled),
                                               ("y", list(range(20)), SamplingParams(max_tokens=4, seed=3))]})
        other, _, _ = serve(LLMEngine(r), {0: [("s", [3, 1, 4, 1, 5], SamplingParams(
            max_tokens=8, temperature=8.0, top_p=0.95, seed=12, n=2))]})
    assert crowd["s"] == alone["s"]
    assert alone["s"][0] != alone["s"][1] and other["s"] != alone["s"]   # the samples draw apart; another seed too


def test_stop_tokens_end_a_sample_and_eos_unless_ignored(tiny):
    model, want = tiny
    prompt = [5, 70, 80, 90, 100, 3]
    expected = greedy(want, prompt, 8)
    stop = expected[3]
    cut = expected[:expected.index(stop) + 1]
    with runner(model) as r:
        tokens, reasons, _ = serve(LLMEngine(r), {0: [
            ("stop", prompt, SamplingParams(max_tokens=8, stop_token_ids=[stop], **GREEDY)),
            ("ignored", prompt, SamplingParams(max_tokens=8, stop_token_ids=[], **GREEDY))]})
        engine = LLMEngine(r)
        engine.eos_token_ids = frozenset({stop})                    # as a model whose end-of-sequence it were
        eos, eos_reasons, _ = serve(engine, {0: [("eos", prompt, SamplingParams(max_tokens=8, **GREEDY)),
                                                 ("bench", prompt, SamplingParams(max_tokens=8, ignore_eos=True,
                                                                                  **GREEDY))]})
    assert tokens["stop"] == [cut] and reasons["stop"] == ["stop"]
    assert tokens["ignored"] == [expected] and reasons["ignored"] == ["length"]
    assert eos["eos"] == [cut] and eos_reasons["eos"] == ["stop"]
    assert eos["bench"] == [expected] and eos_reasons["bench"] == ["length"]


def test_abort_frees_a_request_wherever_it_is(tiny):
    model, _ = tiny
    with runner(model, max_batch=2, num_blocks=8, num_host_blocks=16) as r:
        m = r.cache.blocks
        engine = LLMEngine(r, max_num_batched_tokens=4)
        engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=20, **GREEDY))
        engine.add_request("b", list(range(50, 70)), SamplingParams(max_tokens=20, n=1, **GREEDY))
        engine.add_request("c", [1, 2], SamplingParams(max_tokens=2, **GREEDY))
        engine.step()                                                # a's first chunk: a mid-prompt
        assert engine.num_running == 1 and engine.num_waiting == 2
        assert engine.abort("c") and engine.num_waiting == 1         # waiting
        while not engine.num_swapped:
            engine.step()                                            # b in, then a and b outgrow 8 blocks
        assert engine.abort(engine.swapped[0].id)                    # swapped out
        assert engine.abort(engine.running[0].id)                    # running
        assert not engine.abort("a") and not engine.abort(["unhashable"])
        assert not engine.has_unfinished_requests() and engine.step() == []
        assert m.num_free_blocks == 8 and not m.seqs and len(m.host.free) == 16


def test_rejected_requests_name_the_argument_and_change_nothing(tiny):
    model, _ = tiny
    for params, error, message in [
            (dict(max_tokens=0), ValueError, r"max_tokens must be in \[1, inf\], got 0"),
            (dict(max_tokens=2.0), TypeError, "max_tokens must be an int"),
            (dict(temperature=-0.5), ValueError, "temperature must be a finite number >= 0"),
            (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0"),
            (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
            (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
            (dict(n=0), ValueError, r"n must be in \[1, inf\]"),
            (dict(seed="7"), TypeError, "seed must be an int"),
            (dict(seed=1 << 64), ValueError, "seed must be in"),
            (dict(stop_token_ids="ab"), TypeError, "stop_token_ids must be a sequence of ints"),
            (dict(stop_token_ids=[3, -1]), ValueError, r"stop_token_ids\[1\] must be in"),
            (dict(ignore_eos=1), TypeError, "ignore_eos must be a bool")]:
        with pytest.raises(error, match=message):
            SamplingParams(**params)
    with runner(model, max_batch=2, max_context=32) as r:
        engine = LLMEngine(r)
        free = r.cache.blocks.num_free_blocks
        engine.add_request("taken", [1, 2], SamplingParams(max_tokens=2))
        for args, error, message in [
                (("x", list(range(30)), SamplingParams(max_tokens=3)), ValueError,
                 r"prompt_token_ids has 30 tokens: with max_tokens 3 that is longer than max_context \(32 tokens\)"),
                (("x", [], None), ValueError, "prompt_token_ids must be a non-empty list of token ids"),
                (("x", [1, 267], None), ValueError, r"prompt_token_ids holds token ids outside \[0, 267\)"),
                (("x", "hello", None), ValueError, "prompt_token_ids must be a non-empty list of token ids"),
                (("taken", [1], None), ValueError, "request_id 'taken' is already in use"),
                ((["x"], [1], None), TypeError, "request_id must be hashable"),
                (("x", [1], dict(max_tokens=2)), TypeError, "params must be a SamplingParams"),
                (("x", [1], SamplingParams(n=3)), ValueError, r"n must be at most max_batch \(2\)"),
                (("x", [1], SamplingParams(stop_token_ids=[267])), ValueError,
                 r"stop_token_ids\[0\] must be in \[0, 267\)")]:
            with pytest.raises(error, match=message):
                engine.add_request(*args)
        assert list(engine._requests) == ["taken"] and engine.num_waiting == 1
        assert r.cache.blocks.num_free_blocks == free
    with runner(model, max_batch=2, max_context=32, num_blocks=4, num_host_blocks=8) as r:
        engine = LLMEngine(r)
        with pytest.raises(ValueError, match=r"n \(2\) samples of max_tokens 20 after prompt_token_ids \(9 tokens\) "
                                             r"need 7 blocks, more than the cache's 4"):
            engine.add_request("x", list(range(9)), SamplingParams(n=2, max_tokens=20))
        assert not engine.has_unfinished_requests()
        with pytest.raises(ValueError, match=r"max_num_batched_tokens must be in \[2, inf\]"):
            LLMEngine(r, max_num_batched_tokens=1)
    with runner(model, max_batch=2, max_context=32, num_blocks=4, num_host_blocks=7) as r:
        with pytest.raises(ValueError, match=r"num_host_blocks must be at least 8 \(max_batch 2 sequences of "
                                             r"max_context 32 tokens\) when num_blocks \(4\) is fewer"):
            LLMEngine(r)
    with pytest.raises(TypeError, match="runner must be a ModelRunner"):
        LLMEngine(model)
