"""OpenAI's request and response shapes, the parts this server implements: /v1/completions and
/v1/chat/completions requests (pydantic models, checked as FastAPI reads them), their responses and stream chunks, and
the error body {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    """An error answered with OpenAI's error body: status, message, the request field at fault (param)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share. Others that OpenAI defines (logprobs, penalties, ...) are ignored, as vLLM's
    server ignores what it does not know."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False   # vLLM's extension: generate max_tokens whatever the model says (benchmarks)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = 16   # OpenAI's default for completions


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None   # OpenAI's newer name for max_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Response:
    """The common head of one request's response and its stream chunks."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.id, self.model, self.chat, self.created = request_id, model, chat, int(time.time())

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish_reason: str | None, delta: bool = False,
               first: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if delta:
            message = ({"role": "assistant", "content": text} if first else {"content": text}) \
                if text or first else {}
            return {"index": index, "delta": message, "logprobs": None, "finish_reason": finish_reason}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def whole(self, choices: list[dict], usage_: dict) -> dict:
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage_}

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body
