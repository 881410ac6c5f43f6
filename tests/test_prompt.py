"""PromptRenderer: continuing from an earlier render gives exactly the tokens of a
render from scratch (the engine's former algorithm, kept here as the reference),
through /undo, /retry, edits, system prompt changes and replies given their tokens late.
A reply's exact tokens are its message's `tokens`: the renderer remembers none."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exokv.prompt import render as prompt_module
from exokv.prompt.render import PromptRenderer


@pytest.fixture(scope="module")
def tokenizer(models_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(models_dir / "tiny")


def reference_render(tokenizer, messages) -> list[int]:
    """The render from scratch (the engine's former algorithm, which the bookkeeping
    benchmark times as its "before"): the history templated before every reply, each
    reply's tokens those its message carries."""
    shown = [{k: v for k, v in m.items() if k != "tokens"} for m in messages]

    def template(ms):
        if not ms:
            return ""  # a reply first in the history has nothing before it
        return tokenizer.apply_chat_template(ms, add_generation_prompt=True, tokenize=False)

    def encode(text):
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    text = template(shown)
    tokens: list[int] = []
    pos = 0
    for i, message in enumerate(messages):
        reply = message.get("tokens") if message["role"] == "assistant" else None
        if not reply:
            continue
        head = template(shown[:i])
        end = len(head) + len(message["content"])
        if (
            len(head) < pos
            or not text.startswith(head)
            or text[len(head) : end] != message["content"]
        ):
            continue
        tokens += encode(text[pos : len(head)]) + list(reply)
        pos = end
    return tokens + encode(text[pos:])


class Chat:
    """A conversation whose replies are random token ids, carried by their messages."""

    def __init__(self, tokenizer, renderer: PromptRenderer, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.rng = random.Random(seed)
        self.messages: list[dict] = [{"role": "system", "content": "Be brief."}]

    def words(self, n: int) -> str:
        return " ".join(
            self.rng.choice(["cache", "token", "mac", "rank", "the", "a", "é"]) for _ in range(n)
        )

    def reply(self, tokens: bool = True) -> dict:
        ids = [self.rng.randrange(3, 400) for _ in range(self.rng.randint(3, 12))]
        message = {"role": "assistant", "content": self.tokenizer.decode(ids)}
        return {**message, "tokens": ids} if tokens else message

    def turn(self, tokens: bool = True) -> None:
        self.messages.append({"role": "user", "content": self.words(self.rng.randint(1, 9))})
        self.check()
        self.messages.append(self.reply(tokens))

    def check(self) -> list[int]:
        got = self.renderer.render(self.messages)
        assert got == reference_render(self.tokenizer, self.messages)
        return got


def test_long_conversation_same_tokens_and_each_render_costs_what_is_new(tokenizer):
    renderer = PromptRenderer(tokenizer)
    chat = Chat(tokenizer, renderer)
    for _ in range(3):
        chat.turn()
    for _ in range(40):
        templated, encoded = renderer.templated, renderer.encoded
        chat.turn()
        # One template call for the whole conversation; the reply's head is the
        # previous render's text. Only the new user line and headers are encoded.
        assert renderer.templated - templated == 1
        assert renderer.encoded - encoded < 200
    tokens = chat.check()
    assert len(tokens) > 600  # replies are really in there, as their exact tokens
    for message in chat.messages:
        if message["role"] == "assistant":
            assert _has_run(tokens, message["tokens"])


def test_undo_retry_edit_and_system_prompt_change(tokenizer):
    renderer = PromptRenderer(tokenizer)
    chat = Chat(tokenizer, renderer, seed=1)
    for _ in range(6):
        chat.turn()
    chat.check()
    # /undo: the last exchange goes; then a different question.
    del chat.messages[-2:]
    chat.check()
    chat.turn()
    chat.check()
    # /retry: the last reply replaced by another one.
    chat.messages[-1] = chat.reply()
    chat.check()
    chat.turn()
    # An edit of user turn 2, in place (the dict the renderer saw is changed).
    chat.messages[3]["content"] = "edited " + chat.messages[3]["content"]
    chat.check()
    chat.turn()
    # A new system prompt changes the text before every reply.
    chat.messages[0] = {"role": "system", "content": "Be verbose."}
    chat.check()
    chat.turn()
    chat.check()


def test_a_reply_given_or_losing_its_tokens_later_changes_the_tokens_as_from_scratch(tokenizer):
    renderer = PromptRenderer(tokenizer)
    chat = Chat(tokenizer, renderer, seed=2)
    chat.turn()
    chat.turn(tokens=False)  # e.g. an API client's echoed reply, its tokens found later
    chat.turn()
    before = chat.check()
    late = chat.messages[4]
    chat.messages[4] = {**late, "tokens": [7, 8, 9, 10]}
    after = chat.check()
    assert after != before
    # Without them again: from its text again.
    chat.messages[4] = late
    assert chat.check() == before


def test_tokens_changed_in_place_are_not_taken_for_the_earlier_render(tokenizer):
    renderer = PromptRenderer(tokenizer)
    chat = Chat(tokenizer, renderer, seed=4)
    for _ in range(3):
        chat.turn()
    chat.check()
    chat.messages[2]["tokens"][0] += 1  # the caller's own list, edited after the render
    chat.check()


def test_the_template_never_sees_a_messages_tokens(tokenizer):
    class NoTokens:
        def apply_chat_template(self, messages, **kwargs):
            assert all("tokens" not in m for m in messages)
            return tokenizer.apply_chat_template(messages, **kwargs)

        def encode(self, text, add_special_tokens=False):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    renderer = PromptRenderer(NoTokens())
    chat = Chat(tokenizer, renderer, seed=5)
    for _ in range(3):
        chat.turn()
    assert _has_run(chat.check(), chat.messages[-1]["tokens"])


def test_interleaved_conversations_each_continue_from_their_own_render(tokenizer):
    renderer = PromptRenderer(tokenizer)
    chats = [Chat(tokenizer, renderer, seed=s) for s in range(5)]
    for _ in range(6):
        for chat in chats:
            templated = renderer.templated
            chat.turn()
            assert renderer.templated - templated <= 2


def test_too_many_conversations_fall_back_to_rendering_from_scratch(tokenizer, monkeypatch):
    monkeypatch.setattr(prompt_module, "MAX_RENDERED", 2)
    renderer = PromptRenderer(tokenizer)
    chats = [Chat(tokenizer, renderer, seed=s) for s in range(4)]
    for _ in range(3):
        for chat in chats:
            chat.turn()
    assert len(renderer._rendered) == 2


class LastUserTemplate:
    """A template that marks the last user message (as some mark the last turn): the
    text of earlier messages changes as the conversation grows, so an earlier render's
    tokens must not be continued from, and most replies are not where the head says."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        body = "".join(
            f"<{m['role']}{'!' if i == last else ''}>{m['content']}</{m['role']}>"
            for i, m in enumerate(messages)
        )
        return body + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids):
        return self.inner.decode(ids)


def test_a_template_that_rewrites_earlier_text_renders_from_scratch(tokenizer):
    marking = LastUserTemplate(tokenizer)
    renderer = PromptRenderer(marking)
    chat = Chat(marking, renderer, seed=3)
    for _ in range(5):
        chat.turn()
        # The last reply is found (its head ends with the marked user line) ...
        last = chat.messages[-1]["tokens"]
        assert _has_run(chat.check(), last)
    # ... and after the next user line it is not, because its head changed.
    chat.messages.append({"role": "user", "content": "more"})
    assert not _has_run(chat.check(), last)


def _has_run(tokens, run) -> bool:
    return any(tokens[i : i + len(run)] == run for i in range(len(tokens)))


def test_unhashable_messages_are_rendered_but_not_remembered(tokenizer):
    renderer = PromptRenderer(tokenizer)
    messages = [{"role": "user", "content": "hi", "extra": ["x"]}]
    assert renderer.render(messages) == reference_render(tokenizer, messages)
    assert not renderer._rendered


ACTIONS = st.lists(
    st.sampled_from(["turn", "turn", "turn", "forget", "undo", "retry", "edit", "system"]),
    max_size=14,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=ACTIONS, seed=st.integers(0, 1000))
def test_any_history_renders_as_from_scratch(tokenizer, actions, seed):
    renderer = PromptRenderer(tokenizer)
    chat = Chat(tokenizer, renderer, seed=seed)
    for action in actions:
        n = len(chat.messages)
        if action == "turn":
            chat.turn()
        elif action == "forget":
            chat.turn(tokens=False)
        elif action == "undo" and n >= 3:
            del chat.messages[-2:]
        elif action == "retry" and n >= 3:
            chat.messages[-1] = chat.reply()
        elif action == "edit" and n >= 2:
            i = chat.rng.randrange(1, n)
            chat.messages[i] = {**chat.messages[i], "content": chat.words(3)}
        elif action == "system":
            chat.messages[0] = {"role": "system", "content": chat.words(2)}
        chat.check()


def test_replies_kept_by_text_fill_only_messages_without_tokens(tokenizer):
    """A text-only caller (exokv.bench) keeps replies by their text; a message's own
    tokens win, and without the memory nothing is filled."""
    from exokv.prompt.render import RepliesByText

    chat = Chat(tokenizer, PromptRenderer(tokenizer), seed=6)
    for _ in range(3):
        chat.turn()
    want = chat.check()
    bare = [{k: v for k, v in m.items() if k != "tokens"} for m in chat.messages]
    renderer = PromptRenderer(tokenizer)
    assert renderer.render(bare) != want and renderer.remembered() == []
    renderer.by_text = RepliesByText()
    for message in chat.messages:
        if "tokens" in message:
            renderer.by_text.remember(message["content"], message["tokens"])
    assert renderer.render(bare) == want
    assert renderer.render(chat.messages) == want
