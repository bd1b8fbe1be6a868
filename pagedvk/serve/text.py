"""A sample's text as its tokens arrive: incremental decoding (characters split over tokens held back) and OpenAI's
`stop` strings (the text ends before the first one; text that may be the start of one is held back until it is
known not to be)."""

from __future__ import annotations

from ..models.tokenizer import TextStream


class SampleText:
    """One sample's text. `add(ids)` returns the text to send now; `stopped` turns True at a stop string, after
    which nothing more is added; `finish()` returns what was held back once no token follows."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self._stream = TextStream(tokenizer)
        self.stop = [s for s in stop if s]
        self.text, self.sent, self.stopped = "", 0, False
        self.num_tokens = 0

    def add(self, ids) -> str:
        if self.stopped:
            return ""
        self.num_tokens += len(ids)
        self.text += self._stream.add(ids)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.text += self._stream.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # A stop string may begin in text already sent (held back no further than its length less one).
        start = max(0, self.sent - max((len(s) for s in self.stop), default=1) + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            end = len(self.text)
        else:
            end = len(self.text) if final else len(self.text) - self._held(self.text)
        new, self.sent = self.text[self.sent:end], max(self.sent, end)
        return new

    def _held(self, text: str) -> int:
        """The length of the longest end of text that begins a stop string (it may yet become one)."""
        for n in range(min(len(text), max((len(s) for s in self.stop), default=0) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                return n
        return 0
