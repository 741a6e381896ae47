"""Incremental text of a generation, with stop strings: one implementation for the generation
loop (``Request.stop``), the Python stream and the server."""

from __future__ import annotations


class TextStream:
    """Incremental text of a generation, with OpenAI's ``stop`` strings: :meth:`push` takes each
    token and gives the text that is safe to send (held back while it could still become a stop
    string, or ends inside a multi-byte character); a matched stop string ends the text before it."""

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        self.tokens.append(token)
        self.text = self.decode(self.tokens)
        if self.stops:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                return self.flush()
        safe = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):  # the tokenizer's bytes so far end inside a character
            safe = min(safe, len(self.text) - 1)
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:safe], safe
        return delta

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta
