"""A conversation's prompt tokens, with each earlier reply as the exact tokens generated.

Decoding a reply and encoding it again can give other tokens (BPE picks one split
of the text), which would end the cache match at the first reply. Like
`mlx_lm.chat`, which carries its cache, the model is shown what it produced.

The tokens are:  encode(text[0:head_1]) + reply_1 + encode(text[end_1:head_2]) +
reply_2 + ... + encode(text[end_k:]), where text is the template's output for the
whole conversation, head_i the template's output for the messages before reply i
(with the assistant header), and end_i = head_i + len(reply i's text). A reply
counts only if its message carries its exact tokens (a `tokens` list next to its
`content`: the message holds them, from the turn that generated it to the store and
back) and the text really holds it there; the template never sees the key. Nothing
is remembered about replies here: the messages say it all, so every rank, and a
rank started again, renders a conversation alike.

Rendering that from scratch templates the history once per earlier reply and
encodes all of it: O(turns x history). So every render is remembered (a few dozen,
least recently used dropped), and the next render of the same conversation
continues from it: one template call for the whole conversation, a check that its
output still starts with the text already turned into tokens, and the encoding
of what is new. Anything that changed before that point (an edit, an /undo, a new
system prompt, a reply's tokens added or dropped) makes it start earlier or from
scratch; the tokens are the same either way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_REMEMBERED_REPLIES = 4096  # replies kept by their text (RepliesByText)
MAX_RENDERED = 64  # renders kept to continue from (one per recent conversation or branch)

Message = dict[str, Any]


@dataclass
class _Rendered:
    """One earlier render: its messages, the template's text, and where to resume."""

    messages: list[Message]  # copies: a caller editing its dicts cannot fool the check
    text: str  # the template's output for `messages`, with the generation prompt
    resume: int  # messages before this index were turned into `tokens`
    pos: int  # ... which spell text[:pos]
    tokens: list[int]


class PromptRenderer:
    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template  # Jinja text; None: the tokenizer's own (exokv.model.templates)
        self._rendered: OrderedDict[tuple[int, int], _Rendered] = OrderedDict()
        # Replies' tokens by their text, for messages that carry none: for callers whose
        # conversations are text alone (exokv.bench); None (no memory) on the ranks.
        self.by_text: RepliesByText | None = None
        self.templated = 0  # template calls made (for tests: what a render cost)
        self.encoded = 0  # characters encoded

    def remembered(self) -> list[tuple[str, list[int]]]:
        """The replies kept by their text, oldest first (none without `by_text`)."""
        return self.by_text.items() if self.by_text is not None else []

    def render(self, messages: Sequence[Message]) -> list[int]:
        messages = self.by_text.fill(messages) if self.by_text else list(messages)
        shown = [_shown(m) for m in messages]  # what the template sees: no tokens
        keys = _prefix_keys(messages)
        text = self._template(shown)
        start = self._resumable(messages, keys, text)
        if start is None:
            resume, pos, tokens = 0, 0, []
        else:
            resume, pos, tokens = start.resume, start.pos, list(start.tokens)
        ends: list[tuple[int, int]] = []  # (index, end) of replies not used
        for i in range(resume, len(messages)):
            message = messages[i]
            reply = reply_tokens(message)
            if reply is None:
                continue
            content = message["content"]
            # Where the reply starts: right after the history before it and its header.
            head = self._head(messages, shown, keys, i)
            end = len(head) + len(content)
            if len(head) < pos or not text.startswith(head) or text[len(head) : end] != content:
                ends.append((i, end))
                continue
            tokens += self._encode(text[pos : len(head)]) + reply
            pos, resume = end, i + 1
        if keys is not None and all(end <= pos for i, end in ends if i < resume):
            # Every decision before `resume` read only text[:pos]: a later render whose
            # text starts with it would decide the same, so it may continue from here.
            self._keep(
                keys[len(messages)],
                _Rendered([_copy(m) for m in messages], text, resume, pos, tokens),
            )
        return tokens + self._encode(text[pos:])

    def _resumable(
        self, messages: list[Message], keys: list[tuple[int, int]] | None, text: str
    ) -> _Rendered | None:
        """The longest earlier render this one may continue from, if any."""
        if keys is None:
            return None
        for n in range(len(messages), 0, -1):
            earlier = self._rendered.get(keys[n])
            if earlier is None or messages[:n] != earlier.messages:
                continue
            if not text.startswith(earlier.text[: earlier.pos]):
                continue
            self._rendered.move_to_end(keys[n])
            return earlier
        return None

    def _head(
        self,
        messages: list[Message],
        shown: list[Message],
        keys: list[tuple[int, int]] | None,
        i: int,
    ) -> str:
        """The template's output for messages[:i]: usually the previous render's text."""
        if keys is not None:
            earlier = self._rendered.get(keys[i])
            if earlier is not None and earlier.messages == messages[:i]:
                return earlier.text
        return self._template(shown[:i])

    def _keep(self, key: tuple[int, int], rendered: _Rendered) -> None:
        self._rendered[key] = rendered
        self._rendered.move_to_end(key)
        while len(self._rendered) > MAX_RENDERED:
            self._rendered.popitem(last=False)

    def _template(self, messages: list[Message]) -> str:
        if not messages:
            return ""
        self.templated += 1
        if self.template is None:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=self.template
        )

    def _encode(self, text: str) -> list[int]:
        self.encoded += len(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []


class RepliesByText:
    """Replies' exact tokens by their text (the most recent MAX_REMEMBERED_REPLIES), for
    a caller whose conversations carry none: `fill` gives each reply without `tokens`
    those kept for its text. The front ends' messages carry their own: no rank keeps this."""

    def __init__(self) -> None:
        self._replies: OrderedDict[str, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replies)

    def remember(self, reply: str, tokens: Sequence[int]) -> None:
        if reply and tokens:
            self._replies[reply] = [int(t) for t in tokens]
            self._replies.move_to_end(reply)
            while len(self._replies) > MAX_REMEMBERED_REPLIES:
                self._replies.popitem(last=False)

    def get(self, reply: str) -> list[int] | None:
        tokens = self._replies.get(reply)
        return list(tokens) if tokens else None

    def items(self) -> list[tuple[str, list[int]]]:
        return [(reply, list(tokens)) for reply, tokens in self._replies.items()]

    def fill(self, messages: Sequence[Message]) -> list[Message]:
        return [
            with_reply_tokens(m, self._replies.get(m["content"]))
            if m.get("role") == "assistant" and "tokens" not in m and isinstance(m["content"], str)
            else m
            for m in messages
        ]


def reply_tokens(message: Message) -> list[int] | None:
    """An assistant message's exact tokens, if it carries any."""
    if message.get("role") != "assistant":
        return None
    tokens = message.get("tokens")
    return [int(t) for t in tokens] if tokens else None


def with_reply_tokens(message: Message, tokens: Sequence[int] | None) -> Message:
    """`message` (a reply) carrying `tokens`, its exact tokens; as it is without any."""
    return {**message, "tokens": [int(t) for t in tokens]} if tokens else message


def _shown(message: Message) -> Message:
    return {k: v for k, v in message.items() if k != "tokens"} if "tokens" in message else message


def _copy(message: Message) -> Message:
    copy = dict(message)
    if isinstance(copy.get("tokens"), list):
        copy["tokens"] = list(copy["tokens"])
    return copy


def _prefix_keys(messages: list[Message]) -> list[tuple[int, int]] | None:
    """keys[n] names messages[:n] (a hash; a hit is then compared in full).
    None when a message cannot be hashed: such renders are not remembered."""
    keys = [(0, 0)]
    h = 0
    try:
        for n, message in enumerate(messages, 1):
            items = (
                (k, tuple(v) if k == "tokens" and isinstance(v, list) else v)
                for k, v in message.items()
            )
            h = hash((h, tuple(sorted(items))))
            keys.append((n, h))
    except TypeError:
        return None
    return keys
