"""Stop sequences: text that ends a reply (a base model's next "User:" line, ollama's `stop`).

Checked on every rank alike: each decodes the same tokens into the same text, so
each ends the reply at the same token with no collective. The reply is the text
before the stop; the tokens remembered for it (exokv.prompt.render shows the model its
own tokens) are those that spell exactly that text, or none when the stop begins
inside a token (the reply is then encoded again from its text: the same on every
rank, with or without the cache).

The server cuts a reply at its request's own stop strings with the same matcher, fed
the streamed pieces instead (`stream`, `flush`): one rule for what is held back.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStops:
    """One reply's stop sequences, fed the reply's text after each token (`feed`), or
    the pieces of a streamed reply (`stream`): one way or the other, not both."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        # Characters that may begin a stop not yet complete: not streamed until known.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.lengths = [0]  # the text's length after each token
        self.cut: int | None = None  # where the stop begins, once found
        self.which: str | None = None  # the stop found there (two at one place: the lesser)
        self._text = ""  # what `stream` was fed, and how much of it it let out
        self._sent = 0

    def __bool__(self) -> bool:
        return bool(self.stops)

    @property
    def hit(self) -> bool:
        """Whether a stop ended the reply."""
        return self.cut is not None

    def feed(self, text: str) -> bool:
        """The text after one more token; True when it now holds a stop (at `cut`)."""
        self.lengths.append(len(text))
        if not self.stops or self.cut is not None:
            return self.cut is not None
        start = max(0, self.lengths[-2] - self.hold)
        found = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
        if found:
            self.cut, self.which = min(found)
        return self.cut is not None

    def stream(self, piece: str) -> str:
        """One more piece of the reply; what of the text so far may be sent now."""
        if self.cut is not None:
            return ""
        self._text += piece
        self.feed(self._text)
        return self._send(self.safe(self._text))

    def flush(self) -> str:
        """The streamed reply ended: what was held back is not a stop."""
        return "" if self.cut is not None else self._send(len(self._text))

    def _send(self, end: int) -> str:
        # `safe` of a text shorter than the hold is below 0: nothing to send yet.
        end = max(end, self._sent)
        out, self._sent = self._text[self._sent : end], end
        return out

    def safe(self, text: str) -> int:
        """How much of `text` may be shown: all but what could begin a stop."""
        if self.cut is not None:
            return self.cut
        return len(text) - self.hold if self.stops else len(text)

    def reply(self, text: str) -> str:
        return text if self.cut is None else text[: self.cut]

    def kept(self, generated: Sequence[int]) -> list[int]:
        """The tokens that spell the reply: all of them without a stop; with one, those
        whose text ends where the stop begins ([] when it begins inside a token)."""
        if self.cut is None:
            return list(generated)
        for k in range(len(self.lengths) - 1, -1, -1):
            if self.lengths[k] <= self.cut:
                return list(generated[:k]) if self.lengths[k] == self.cut else []
        return []
