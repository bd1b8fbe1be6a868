"""pagedvk.serve, the OpenAI-compatible server, through a real HTTP client (httpx) on a loopback port: completions and
chat, whole and streamed, n samples, stop strings, concurrent requests (each one's text that of the float64
reference's greedy tokens for it alone), the errors (400 naming the field, 404, 429) in OpenAI's shape, a client
that goes away, and `pagedvk serve` itself."""

import json
import signal
import socket
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from models import tiny_model  # noqa: E402
from support import run_python  # noqa: E402

import pagedvk  # noqa: E402
from pagedvk.models import reference  # noqa: E402
from pagedvk.models.engine import LLMEngine  # noqa: E402
from pagedvk.serve.app import create_app  # noqa: E402
from pagedvk.serve.server import serve_in_thread  # noqa: E402
from pagedvk.serve.worker import EngineWorker  # noqa: E402
from pagedvk.serve.text import SampleText  # noqa: E402

TIMEOUT = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, the loaded model, the Model its file holds): a float16 llama, context 64."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    want = tiny_model.write(path)
    return path, pagedvk.load_model(path), want


class Server:
    def __init__(self, model, max_batch=4, max_waiting=16, start=True):
        self.runner = pagedvk.ModelRunner(model, max_batch=max_batch, block_size=8)
        self.engine = LLMEngine(self.runner)
        self.worker = EngineWorker(self.engine, max_waiting=max_waiting)
        if start:
            self.worker.start()
        self.http, self.thread, port = serve_in_thread(create_app(self.worker, "tiny"))
        self.url = f"http://127.0.0.1:{port}"

    def post(self, path, **body):
        return httpx.post(self.url + path, json=body, timeout=TIMEOUT)

    def stream(self, path, **body):
        """The stream's parsed chunks, and the raw lines (the last must be `data: [DONE]`)."""
        with httpx.stream("POST", self.url + path, json={**body, "stream": True}, timeout=TIMEOUT) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]], lines

    def close(self):
        self.http.should_exit = True
        self.thread.join(30)
        self.worker.close(30)
        self.runner.close()


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny[1])
    yield s
    s.close()


def expected(want, tokenizer, prompt_ids, max_tokens):
    """(text, finish_reason, completion tokens) of the float64 reference's greedy tokens, cut at a stop token."""
    tokens = reference.greedy(want, prompt_ids, max_tokens, np.float16)
    stops = [i for i, t in enumerate(tokens) if t in tokenizer.stop_ids]
    if stops:
        return tokenizer.decode(tokens[:stops[0]]), "stop", stops[0] + 1
    return tokenizer.decode(tokens), "length", len(tokens)


def test_models_lists_the_served_model(server):
    r = httpx.get(server.url + "/v1/models", timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.json()["object"] == "list" and [(m["id"], m["object"], m["max_model_len"]) for m in r.json()["data"]] \
        == [("tiny", "model", 64)]


def test_completions_whole_and_streamed_are_the_greedy_tokens(tiny, server):
    _, model, want = tiny
    tok = model.tokenizer
    prompt = " the and"
    text, reason, n = expected(want, tok, tok.encode(prompt), 10)
    r = server.post("/v1/completions", model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, text, reason)]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": n, "total_tokens": 2 + n}
    chunks, _ = server.stream("/v1/completions", prompt=prompt, max_tokens=10, temperature=0,
                              stream_options={"include_usage": True})
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == text
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == reason
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    ids = tok.encode(prompt)                                        # a prompt of token ids
    r = server.post("/v1/completions", prompt=ids, max_tokens=10, temperature=0)
    assert r.json()["choices"][0]["text"] == text


def test_chat_whole_and_streamed_use_the_chat_template(tiny, server):
    _, model, want = tiny
    tok = model.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    ids = tok.encode(tok.chat("hi"))
    text, reason, n = expected(want, tok, ids, 6)
    r = server.post("/v1/chat/completions", messages=messages, max_tokens=6, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                "finish_reason": reason}]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == n
    chunks, _ = server.stream("/v1/chat/completions", messages=[{"role": "user", "content": [
        {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}], max_completion_tokens=6, temperature=0)
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert deltas[0] == {"role": "assistant", "content": ""} and all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == reason


def test_n_samples_and_seeds(tiny, server):
    _, model, want = tiny
    tok = model.tokenizer
    text, reason, _ = expected(want, tok, tok.encode(" the"), 8)
    r = server.post("/v1/completions", prompt=" the", max_tokens=8, temperature=0, n=2)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in r.json()["choices"]] == [(0, text, reason),
                                                                                       (1, text, reason)]
    chunks, _ = server.stream("/v1/completions", prompt=" the", max_tokens=8, temperature=0, n=2)
    for i in range(2):
        assert "".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == i) == text
    # The tiny model's logits lie far apart (tiny_model.write): a high temperature makes its draws differ.
    drawn = [server.post("/v1/completions", prompt=" the", max_tokens=8, temperature=8.0, seed=seed, n=2).json()
             for seed in (5, 5, 6)]
    texts = [[c["text"] for c in d["choices"]] for d in drawn]
    assert texts[0] == texts[1] and texts[0] != texts[2] and texts[0][0] != texts[0][1]


def test_stop_strings_end_the_text_before_them(tiny, server):
    _, model, want = tiny
    tok = model.tokenizer
    prompt = " the and"
    text, _, _ = expected(want, tok, tok.encode(prompt), 12)
    stop = text[5:7]
    cut = text[:text.index(stop)]
    r = server.post("/v1/completions", prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "never"])
    assert [(c["text"], c["finish_reason"]) for c in r.json()["choices"]] == [(cut, "stop")]
    assert r.json()["usage"]["completion_tokens"] < 12
    chunks, _ = server.stream("/v1/completions", prompt=prompt, max_tokens=12, temperature=0, stop=stop)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    time.sleep(0.2)   # the abort of the samples that ran on reaches the engine at its next step
    assert not server.engine.has_unfinished_requests()


def test_an_end_of_sequence_token_ends_the_text_unless_ignored(tiny, server):
    _, model, want = tiny
    tok = model.tokenizer
    ids = tok.encode(" the and")
    tokens = reference.greedy(want, ids, 8, np.float16)
    eos = tokens[3]
    cut = tokens[:tokens.index(eos)]
    kept = server.engine.eos_token_ids
    server.engine.eos_token_ids = frozenset({eos})     # as a model whose end-of-sequence token it were
    try:
        stopped = server.post("/v1/completions", prompt=ids, max_tokens=8, temperature=0).json()
        ignored = server.post("/v1/completions", prompt=ids, max_tokens=8, temperature=0, ignore_eos=True).json()
    finally:
        server.engine.eos_token_ids = kept
    assert (stopped["choices"][0]["text"], stopped["choices"][0]["finish_reason"]) == (tok.decode(cut), "stop")
    assert stopped["usage"]["completion_tokens"] == len(cut) + 1   # the end-of-sequence token counts, unshown
    assert (ignored["choices"][0]["text"], ignored["choices"][0]["finish_reason"]) == (tok.decode(tokens), "length")


def test_an_engine_failure_ends_its_requests_with_500_and_the_server_goes_on(server):
    step = server.engine.step

    def failing():
        server.engine.step = step                      # once
        raise RuntimeError("device lost (a test's)")

    server.engine.step = failing
    r = server.post("/v1/completions", prompt=" the", max_tokens=4, temperature=0)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "the engine failed: device lost (a test's)" in r.json()["error"]["message"]
    server.engine.step = failing
    chunks, lines = server.stream("/v1/completions", prompt=" the", max_tokens=4, temperature=0)
    assert "device lost" in chunks[-1]["error"]["message"]   # the stream's last event, before [DONE]
    assert server.post("/v1/completions", prompt=" the", max_tokens=4, temperature=0).status_code == 200
    assert server.runner.cache.blocks.num_free_blocks == server.runner.cache.num_blocks


def test_sample_text_holds_back_what_may_begin_a_stop_string(tiny):
    tok = tiny[1].tokenizer
    ids = lambda text: tok.encode(text)
    t = SampleText(tok, ["abc", "zz"])
    assert t.add(ids("xa")) == "x"                 # "a" may begin "abc"
    assert t.add(ids("b")) == ""                   # "ab" too
    assert t.add(ids("d")) == "abd"                # not any more
    assert t.add(ids("yab")) == "y" and t.add(ids("cq")) == "" and t.stopped and t.text == "xabdy"
    assert t.add(ids("more")) == "" and t.finish() == ""
    t = SampleText(tok, ["zz"])
    assert t.add(ids("az")) == "a" and t.finish() == "z" and t.text == "az" and not t.stopped
    t = SampleText(tok, [])
    assert t.add(ids("é")[:1]) == "" and t.add(ids("é")[1:]) == "é"   # a character split over two byte tokens


def test_concurrent_requests_each_get_their_greedy_tokens_alone(tiny, server):
    _, model, want = tiny
    tok = model.tokenizer
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (3, 17, 9, 30, 1, 12)]
    lengths = [12, 5, 20, 7, 16, 9]

    def ask(i):
        body = dict(prompt=prompts[i], max_tokens=lengths[i], temperature=0)
        if i % 2:
            chunks, _ = server.stream("/v1/completions", **body)
            return "".join(ch["text"] for c in chunks for ch in c["choices"])
        return server.post("/v1/completions", **body).json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:   # six at once over a max_batch of 4: some wait for others
        texts = list(pool.map(ask, range(len(prompts))))
    assert texts == [expected(want, tok, p, n)[0] for p, n in zip(prompts, lengths)]


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/v1/completions", dict(prompt="x" * 70), 400, "prompt",
     "This model's maximum context length is 64 tokens, and the prompt came to 70 tokens, which leaves none"),
    ("/v1/completions", dict(prompt="x", max_tokens=64), 400, "max_tokens",
     "the prompt (1 tokens) with max_tokens 64 make 65"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x" * 40}]), 400, "messages",
     "the messages came to 89 tokens"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], max_completion_tokens=20), 400,
     "max_completion_tokens", "the messages (50 tokens) with max_completion_tokens 20 make 70"),
    ("/v1/completions", dict(prompt="x", max_tokens=0), 400, "max_tokens", "max_tokens must be in [1, inf], got 0"),
    ("/v1/completions", dict(prompt="x", temperature=-1), 400, "temperature", "temperature must be a finite number"),
    ("/v1/completions", dict(prompt="x", top_p=0), 400, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", dict(prompt="x", n=5), 400, "n", "n must be at most max_batch (4), got 5"),
    ("/v1/completions", dict(prompt="x", n="two"), 400, "n", "n: Input should be a valid integer"),
    ("/v1/completions", dict(prompt=[1, 999]), 400, "prompt", "prompt holds token ids outside [0, 267)"),
    ("/v1/completions", dict(max_tokens=3), 400, "prompt", "prompt: Field required"),
    ("/v1/chat/completions", dict(messages=[]), 400, "messages", "messages: List should have at least 1 item"),
    ("/v1/completions", dict(prompt="x", model="gpt-4"), 404, "model", "The model `gpt-4` does not exist"),
])
def test_bad_requests_get_openai_errors_naming_the_field(server, path, body, status, param, message):
    r = server.post(path, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_a_full_queue_answers_429(tiny):
    _, model, want = tiny
    s = Server(model, max_batch=1, max_waiting=2, start=False)   # the engine waits: requests stay queued
    try:
        with ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(s.post, "/v1/completions", prompt=" the", max_tokens=3, temperature=0)
                      for _ in range(2)]
            for _ in range(1000):
                if s.worker.num_waiting == 2:
                    break
                time.sleep(0.01)
            r = s.post("/v1/completions", prompt=" the", max_tokens=3)
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error" and "2 requests are waiting" in \
                r.json()["error"]["message"] and "--max-waiting 2" in r.json()["error"]["message"]
            s.worker.start()                                            # the queued ones are served
            text = expected(want, model.tokenizer, model.tokenizer.encode(" the"), 3)[0]
            assert [f.result().json()["choices"][0]["text"] for f in queued] == [text, text]
    finally:
        s.close()


def test_a_client_that_goes_away_aborts_its_request(tmp_path):
    # A model of a longer context, so that a request runs for seconds: the tiny one decodes a token in milliseconds.
    tiny_model.write(tmp_path / "long.gguf", context=1024)
    s = Server(pagedvk.load_model(tmp_path / "long.gguf"))
    try:
        long = dict(prompt=[1], max_tokens=1000, temperature=0)
        with httpx.stream("POST", s.url + "/v1/completions", json=dict(long, stream=True), timeout=TIMEOUT) as r:
            next(r.iter_lines())                                        # it runs; then the client leaves
        with pytest.raises(httpx.ReadTimeout):                          # a whole response, waited for too briefly
            httpx.post(s.url + "/v1/completions", json=long, timeout=0.5)
        for _ in range(1000):
            if not s.engine.has_unfinished_requests():
                break
            time.sleep(0.01)
        assert not s.engine.has_unfinished_requests()
        assert s.engine.stats["generated_tokens"] < 1000                # neither ran to its end
        assert s.runner.cache.blocks.num_free_blocks == s.runner.cache.num_blocks
    finally:
        s.close()


def test_pagedvk_serve_answers_and_stops_on_interrupt(tiny):
    path, model, want = tiny
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from pagedvk.cli import main; sys.exit(main())",
                             "serve", "--model", str(path), "--port", str(port), "--max-batch", "2",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # not the checkout's root: `python -c` puts the working directory first on sys.path, and
                            # a checkout's pagedvk without built modules shadowed the installed one (CI's fresh clone)
                            cwd=str(path.parent),
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                p for p in (str(Path(pagedvk.__file__).parent.parent), os.environ.get("PYTHONPATH"))
                                if p)))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        models = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"]
        assert [m["id"] for m in models] == ["tiny"]
        r = httpx.post(url + "/v1/completions", json=dict(prompt=" the and", max_tokens=5, temperature=0),
                       timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected(want, model.tokenizer, model.tokenizer.encode(" the and"),
                                                          5)[0]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"serving tiny on http://127.0.0.1:{port}/v1" in err and "max_batch 2" in err


@pytest.mark.parametrize("argv, message", [
    (["--max-context", "100"], "--max-context 100 is more than the model's context_length 64"),
    (["--num-blocks", "8"], "num_host_blocks must be at least 32 (max_batch 8 sequences of max_context 64 tokens) "
                            "when num_blocks (8) is fewer"),
])
def test_pagedvk_serve_refuses_bad_options(tiny, argv, message):
    result = run_python("import sys; from pagedvk.cli import main; sys.exit(main(sys.argv[1:]))",
                        argv=["serve", "--model", str(tiny[0]), *argv])
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_pagedvk_serve_without_the_serve_extra_says_how_to_install_it(tiny):
    hide = "import sys\nsys.modules['fastapi'] = None\n"
    result = run_python(hide + "from pagedvk.cli import main\nsys.exit(main(sys.argv[1:]))",
                        argv=["serve", "--model", str(tiny[0])])
    assert result.returncode == 2, result.stderr
    assert "pagedvk.serve needs the 'fastapi' package: pip install 'pagedvk[serve]'" in result.stderr
