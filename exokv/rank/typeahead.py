"""Prefill while the user types (issue 22): the draft's tokens, its entries, the feed of steps.

A draft is the line the user has not sent yet. Its *stable* part is what the turn will
still begin with whatever the user types next: the text without its last, perhaps
partial, word, and the conversation's tokens without what the chat template appends
after the user's text. `Engine.typeahead_step` prefills that part a chunk at a time into the
prefix tree as ordinary entries; the turn then finds it as a hit. Nothing here decides
a reply: the tree is keyed by exact tokens, so a draft edited in the middle, deleted or
abandoned only leaves entries no turn matches.

Draft entries are put first in the tree's LRU order (`RadixTree.put_first`), so a tight
budget evicts them before anything a turn used; a turn's fetch touches what it uses,
which makes those entries ordinary. Both are tree state, the same on every rank.
"""

from __future__ import annotations

import queue
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from exokv.cache.radix import Node, RadixTree
from exokv.wire.messages import Draft, Shutdown, Turn
from exokv.wire.messages import Message as WireMessage

STEP_TOKENS = 256  # tokens per typeahead step: what Enter may wait for, at most
PROBE = " x"  # stands for whatever the user types next, to find where the draft's tokens end
_LAST_WORD = re.compile(r"\s*\S*\Z")

Message = dict[str, str]


def stable_text(draft: str) -> str:
    """The draft without its last word (which may still grow) and the blank before it."""
    if draft.startswith("/"):
        return ""  # a command, not a message
    return _LAST_WORD.sub("", draft)


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class DraftTokens:
    """The tokens a draft lets the ranks prefill, and where the earlier messages end."""

    tokens: list[int]
    history: int  # tokens before the draft's own (the conversation so far)


def draft_tokens(
    render: Callable[[list[Message]], list[int]], messages: Sequence[Message], draft: str
) -> DraftTokens | None:
    """The conversation rendered up to the draft's stable part; None: nothing to prefill.

    The tokens shared by the render with the stable text and the render with it and
    one more word: the template's suffix and a token the next word could merge with
    are left out, so a turn that sends more text still starts with these tokens."""
    text = stable_text(draft)
    if not text.strip():
        return None
    history = list(messages)
    with_text = render([*history, {"role": "user", "content": text}])
    with_more = render([*history, {"role": "user", "content": text + PROBE}])
    stable = common_length(with_text, with_more) - 1  # the last one may still merge
    before = common_length(with_text, render(history)) if history else 0
    if stable <= before:
        return None
    return DraftTokens(with_text[:stable], before)


def draft_ids(tree: RadixTree, tokens: Sequence[int]) -> set[int]:
    """The draft entries (put first, not used by a turn since) `tokens` runs through."""
    return {n.id for n in tree.match(tokens).path if n.last_used < 0}


def put_draft_first(
    tree: RadixTree,
    path: Sequence[Node],
    history: int,
    drafted: set[int],
    added: Sequence[Node],
    changed: Sequence[Node],
) -> None:
    """After a typeahead insert, put the draft's own entries on `path` first again:
    those past the history that were draft entries (`drafted`, read before the step)
    or are new, but not the upper part of an ordinary entry the insert cut."""
    new = {n.id for n in added}
    cut_ordinary = {c.parent.id for c in changed if c.parent is not None and c.id not in drafted}
    tree.put_first(
        [
            n
            for n in path
            if n.depth > history and (n.id in drafted or (n.id in new and n.id not in cut_ordinary))
        ]
    )


def drafted_spans(tree: RadixTree, tokens: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of the draft entries (put first, not used by a turn since) that
    `tokens` runs through: read before a turn's fetch touches them."""
    return [(n.start, n.depth) for n in tree.match(tokens).path if n.last_used < 0]


def covered(spans: Sequence[tuple[int, int]], length: int) -> int:
    """Tokens of `spans` within the first `length` (a hit's): what typing ahead gave."""
    return sum(max(0, min(end, length) - start) for start, end in spans)


class DraftFeed:
    """Rank 0's next message, with the newest draft stepped while nothing else waits.

    A newer draft replaces an older one, an empty draft abandons it, and a turn (Enter)
    ends it: what was prefilled stays in the tree for the turn to find. `on_done(id)`
    hears of every draft that will get no more steps (so a waiting client can go on).
    """

    def __init__(self, on_done: Callable[[Any], None] | None = None) -> None:
        self.pending: Draft | None = None
        self._on_done = on_done

    def next(self, inbox: queue.Queue[WireMessage]) -> WireMessage:
        while True:
            if self.pending is None:
                message = inbox.get()
            else:
                try:
                    message = inbox.get_nowait()
                except queue.Empty:
                    return self.pending
            if isinstance(message, Draft):
                self._end()
                self.pending = message if message.draft else None
                if self.pending is None and self._on_done is not None:
                    self._on_done(message.id)
                continue
            if isinstance(message, (Turn, Shutdown)):
                self._end()
            return message

    def stepped(self, left: int) -> None:
        """The pending draft ran a step; `left` tokens of it remain (0: it is done)."""
        if left <= 0:
            self._end()

    def _end(self) -> None:
        if self.pending is not None and self._on_done is not None:
            self._on_done(self.pending.id)
        self.pending = None
