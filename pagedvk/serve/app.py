"""The OpenAI-compatible HTTP API over an EngineWorker (FastAPI): /v1/models, /v1/completions and
/v1/chat/completions, streamed (server-sent events, `data: {...}` chunks then `data: [DONE]`) or whole.

A request is checked (400 naming the field, OpenAI's error body), handed to the worker (429 where its queue is full)
and answered from the outputs the worker's thread hands back through loop.call_soon_threadsafe. A client that goes
away aborts its request: a stream's generator is cancelled by Starlette, a whole response races the disconnect.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
import uuid


def require(module: str):
    """Import one of the `serve` extra's packages, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"pagedvk.serve needs the {module!r} package: pip install 'pagedvk[serve]'") from e


require("fastapi")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, Response as HTTPResponse, StreamingResponse  # noqa: E402

from ..models.params import SamplingParams  # noqa: E402
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, Response, usage  # noqa: E402
from .text import SampleText  # noqa: E402
from .worker import EngineWorker, QueueFullError  # noqa: E402


def create_app(worker: EngineWorker, model_name: str) -> FastAPI:
    """The API serving `worker`'s engine under `model_name` (its runner's model, whose tokenizer and chat template
    the endpoints use)."""
    runner = worker.engine.runner
    tokenizer, max_context = runner.model.tokenizer, runner.max_context
    if tokenizer is None:
        raise ValueError("the model has no tokenizer (tokenizer.ggml.tokens): the API takes and returns text")
    app = FastAPI(title="pagedvk", description="An OpenAI-compatible API over pagedvk's engine")
    created = int(time.time())

    @app.exception_handler(OpenAIError)
    async def openai_error(request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, e: RequestValidationError):
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None   # loc: ("body", field, ...)
        return JSONResponse(OpenAIError(400, f"{param or 'body'}: {first['msg']}", param).body(), status_code=400)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "pagedvk", "max_model_len": max_context}]}

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        ids = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)
        return await generate(request, body, ids, "prompt", "max_tokens", body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            text = tokenizer.chat([{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as e:   # a template this tokenizer does not render
            raise OpenAIError(400, f"messages: {e}", "messages") from None
        limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return await generate(request, body, tokenizer.encode(text), "messages", limit, getattr(body, limit),
                              chat=True)

    async def generate(request: Request, body, ids: list, prompt_field: str, limit_field: str, limit: int | None,
                       chat: bool):
        if body.model is not None and body.model != model_name:
            raise OpenAIError(404, f"The model `{body.model}` does not exist (this server serves `{model_name}`)",
                              "model", code="model_not_found")
        if len(ids) >= max_context:
            raise OpenAIError(400, f"This model's maximum context length is {max_context} tokens, and the "
                                   f"{prompt_field} came to {len(ids)} tokens, which leaves none to generate",
                              prompt_field, code="context_length_exceeded")
        limit = max_context - len(ids) if limit is None else limit
        if isinstance(limit, int) and len(ids) + limit > max_context:
            raise OpenAIError(400, f"This model's maximum context length is {max_context} tokens, and the "
                                   f"{prompt_field} ({len(ids)} tokens) with {limit_field} {limit} make "
                                   f"{len(ids) + limit}", limit_field, code="context_length_exceeded")
        try:
            params = SamplingParams(max_tokens=limit, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                    n=body.n, ignore_eos=body.ignore_eos)
            worker.check(ids, params)
        except (ValueError, TypeError) as e:   # the messages start with the argument's name
            name = str(e).split(" ", 1)[0].split("[", 1)[0]
            field = {"prompt_token_ids": prompt_field, "max_tokens": limit_field}.get(name, name)
            raise OpenAIError(400, f"{field}{str(e)[len(name):]}", field) from None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            worker.submit(request_id, ids, params, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
        except QueueFullError as e:
            raise OpenAIError(429, str(e), None, type="rate_limit_error", code="rate_limit_exceeded") from None
        answer = Answer(Response(request_id, model_name, chat), len(ids), params.n,
                        [SampleText(tokenizer, body.stop_strings()) for _ in range(params.n)])
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(answer, outputs, request_id, include_usage),
                                     media_type="text/event-stream")
        collect = asyncio.ensure_future(answer.collect(outputs, worker, request_id))
        gone = asyncio.ensure_future(disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():             # the client went away: nobody reads the answer
            collect.cancel()
            worker.abort(request_id)
            return HTTPResponse(status_code=499)
        gone.cancel()
        return collect.result()

    async def stream(answer: Answer, outputs: asyncio.Queue, request_id: str, include_usage: bool):
        try:
            if answer.response.chat:   # each choice's first chunk names the role, as OpenAI's do
                yield sse(answer.response.chunk([answer.response.choice(i, "", None, delta=True, first=True)
                                                 for i in range(answer.n)]))
            try:
                async for choices in answer.events(outputs, worker, request_id):
                    yield sse(answer.response.chunk(choices))
            except OpenAIError as e:   # the status line has gone: the error is the stream's last event
                answer.done = True
                yield sse(e.body())
            else:
                if include_usage:
                    yield sse(answer.response.chunk([], answer.usage()))
            yield "data: [DONE]\n\n"
        finally:
            if not answer.done:            # cancelled: the client went away
                worker.abort(request_id)

    return app


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body is read: what the server receives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Answer:
    """One request's samples as the engine's outputs arrive: their text (stop strings applied), finish reasons and
    token counts."""

    def __init__(self, response: Response, prompt_tokens: int, n: int, texts: list[SampleText]) -> None:
        self.response, self.prompt_tokens, self.n, self.texts = response, prompt_tokens, n, texts
        self.reasons: list[str | None] = [None] * n
        self.tokens = [0] * n
        self.done = False

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(self.tokens))

    async def events(self, outputs: asyncio.Queue, worker: EngineWorker, request_id: str):
        """Each engine output's new text and finish reasons as choices (delta form for chat), until every sample
        has ended; a sample that ends at a stop string while others run is left to run out unread."""
        while not self.done:
            out = await outputs.get()
            if out is None:
                raise OpenAIError(500, "the request was aborted by the server", type="server_error")
            if isinstance(out, Exception):
                raise OpenAIError(500, f"the engine failed: {out}", type="server_error")
            choices = []
            for s in out.outputs:
                i = s.index
                if self.reasons[i] is not None:
                    continue
                self.tokens[i] += len(s.new_token_ids)
                # a stop token (end of sequence) ends the text without being part of it
                ids = s.new_token_ids[:-1] if s.finish_reason == "stop" else s.new_token_ids
                text = self.texts[i].add(ids)
                if s.finish_reason is not None or self.texts[i].stopped:
                    text += self.texts[i].finish()
                    self.reasons[i] = "stop" if self.texts[i].stopped else s.finish_reason
                if text or self.reasons[i] is not None:
                    choices.append(self.response.choice(i, text, self.reasons[i], delta=True))
            if all(r is not None for r in self.reasons):
                self.done = True
                if not out.finished:       # ended by stop strings: the engine's samples still run
                    worker.abort(request_id)
            if choices:
                yield choices

    async def collect(self, outputs: asyncio.Queue, worker: EngineWorker, request_id: str) -> dict:
        async for _ in self.events(outputs, worker, request_id):
            pass
        choices = [self.response.choice(i, self.texts[i].text, self.reasons[i]) for i in range(self.n)]
        return self.response.whole(choices, self.usage())
