"""exokv.serve's pure parts: request checks, stop strings, session names, the warning."""

from __future__ import annotations

import json
from threading import Event

import pytest

from exokv.rank.stops import TextStops
from exokv.serve import api
from exokv.serve.run import ServeOptions, check, model_names
from tests.stub_client import StubClient


def parse(doc: dict, **limits: int) -> api.ChatCall:
    return api.parse_chat(
        json.dumps(doc).encode(), {"builtin:tiny"}, api.Defaults(), api.Limits(**limits)
    )


def test_fields_and_defaults() -> None:
    call = parse(
        {"messages": [{"role": "developer", "content": "sys"}, {"role": "user", "content": "hi"}]}
    )
    assert call.messages[0] == {"role": "system", "content": "sys"}
    assert (call.max_tokens, call.temperature, call.stream, call.stop) == (256, 0.0, False, [])
    call = parse(
        {
            "model": "builtin:tiny",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "stop": "x",
            "seed": -1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert call.messages[0]["content"] == "ab" and call.max_tokens == 7 and call.stop == ["x"]
    assert call.seed == 2**64 - 1 and call.include_usage


def test_limits_are_enforced() -> None:
    user = {"role": "user", "content": "hi"}
    with pytest.raises(api.ApiError, match="at most 3"):
        parse({"messages": [user] * 4}, messages=3)
    with pytest.raises(api.ApiError, match="characters"):
        parse({"messages": [{"role": "user", "content": "x" * 11}]}, message_chars=10)
    with pytest.raises(api.ApiError, match="stop"):
        parse({"messages": [user], "stop": ["a", "b", "c", "d", "e"]})
    with pytest.raises(api.ApiError) as caught:
        parse({"messages": [user], "model": "other"})
    assert caught.value.status == 404


@pytest.mark.parametrize("pieces", [["ab", "cSTO", "Pde"], ["abcS", "T", "O", "P"], ["abcSTOPde"]])
def test_stop_text_cuts_at_the_stop_string_however_it_is_split(pieces: list[str]) -> None:
    cut = TextStops(["STOP", "zz"])
    out = "".join(cut.stream(p) for p in pieces) + cut.flush()
    assert out == "abc" and cut.hit


def test_stop_text_without_a_hit_sends_everything() -> None:
    cut = TextStops(["STOP"])
    out = "".join(cut.stream(p) for p in ["ST", "OR", "Y"]) + cut.flush()
    assert out == "STORY" and not cut.hit
    assert TextStops([]).stream("abc") == "abc"


def test_one_conversation_is_one_session() -> None:
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    other = [{"role": "user", "content": "hi"}]
    assert api.conversation_name(first) == api.conversation_name(later)
    assert api.conversation_name(first) != api.conversation_name(other)
    assert api.conversation_name(first).startswith("api-")


def test_another_address_without_a_key_is_warned_about() -> None:
    from exokv.frontend.start import ChatOptions

    tiny = ChatOptions(model="builtin:tiny")
    assert check(ServeOptions(tiny)) == []
    assert check(ServeOptions(tiny, host="::1")) == []
    warned = check(ServeOptions(tiny, host="0.0.0.0"))
    assert len(warned) == 1 and "--api-key" in warned[0] and "in clear" in warned[0]
    assert check(ServeOptions(tiny, host="0.0.0.0", api_key="k")) == []


def test_a_local_path_is_shown_by_its_name(tmp_path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    shown, names = model_names(str(model))
    assert shown == "my-model" and names == {"my-model", str(model)}
    assert model_names("builtin:tiny") == ("builtin:tiny", {"builtin:tiny"})


def test_the_recorder_stores_each_turn_and_keeps_nothing_in_memory(tmp_path) -> None:
    from types import SimpleNamespace

    from exokv.core.records import TurnRequest, TurnResult
    from exokv.frontend.hooks import StoreHooks
    from exokv.serve.run import _Recorder
    from exokv.state import Store

    with Store.open(tmp_path) as store:
        hooks = StoreHooks(store, store.start_run("m", 1, [None]), "m", client=StubClient())
        record = _Recorder(hooks)
        history = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
        for reply in ("one", "two"):
            request = TurnRequest(api.conversation_name(history), list(history))
            result = TurnResult(request.session, reply, 5, 0, 5, 2, 0.1, 1.0, 0.0, 1)
            result.reply_tokens = [len(reply), 1]  # the result carries the reply's tokens
            record(SimpleNamespace(request=request, result=result, reply=reply, cancelled=Event()))
            assert not hooks._system  # nothing kept per session
            history += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "more"},
            ]
        stored = store.load_messages(request.session, with_tokens=True)
        assert [m["content"] for m in stored] == ["hi", "one", "more", "two"]
        assert [m.get("tokens") for m in stored if m["role"] == "assistant"] == [[3, 1], [3, 1]]
        assert store.get_system(request.session) == "s"


def test_a_call_the_client_left_ending_last_leaves_the_conversation_as_the_new_call_wrote_it(
    tmp_path,
) -> None:
    """A client leaves a stream and sends the call again: both are turns of one session,
    and the one it left may end last. Its partial reply must not replace the reply of the
    call the client kept, nor lose that reply's tokens (the next call needs them)."""
    from types import SimpleNamespace

    from exokv.core.records import TurnRequest, TurnResult
    from exokv.frontend.hooks import StoreHooks
    from exokv.serve.run import _Recorder
    from exokv.state import Store

    def job(request: TurnRequest, reply: str, tokens: list[int], left: bool) -> SimpleNamespace:
        result = TurnResult(request.session, reply, 5, 0, 5, 2, 0.1, 1.0, 0.0, 1)
        result.reply_tokens = tokens
        cancelled = Event()
        if left:
            cancelled.set()
        return SimpleNamespace(request=request, result=result, reply=reply, cancelled=cancelled)

    with Store.open(tmp_path) as store:
        hooks = StoreHooks(store, store.start_run("m", 1, [None]), "m", client=StubClient())
        record = _Recorder(hooks)
        first = [{"role": "user", "content": "hi"}]
        session = api.conversation_name(first)
        record(job(TurnRequest(session, first), "one", [7, 8], left=False))
        again = [
            *first,
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "more"},
        ]
        request = TurnRequest(session, again)
        record(job(request, "the whole reply", [1, 2, 3], left=False))  # the call it kept
        record(job(request, "the wh", [1], left=True))  # the one it left, ending last
        stored = store.load_messages(session, with_tokens=True)
        assert [m["content"] for m in stored] == ["hi", "one", "more", "the whole reply"]
        assert [m.get("tokens") for m in stored if m["role"] == "assistant"] == [[7, 8], [1, 2, 3]]


def test_a_client_cannot_send_the_marker_roles() -> None:
    from exokv.prompt.markers import RAW, TOOLS

    for role in (RAW, TOOLS):
        body = json.dumps({"messages": [{"role": role, "content": "x"}]}).encode()
        with pytest.raises(api.ApiError, match="role"):
            api.parse_chat(body, {"m"}, api.Defaults(), api.Limits())


def test_developer_is_rendered_as_system() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ]
    }
    call = api.parse_chat(json.dumps(body).encode(), {"m"}, api.Defaults(), api.Limits())
    assert call.messages[0] == {"role": "system", "content": "be brief"}


def test_the_marked_template_reads_a_raw_prompt_and_tools() -> None:
    from exokv.prompt.markers import Marked, raw_prompt, tools_message

    seen: list[tuple[list, dict]] = []

    class Tokenizer:
        def apply_chat_template(self, messages: list, **kw: object) -> str:
            seen.append((messages, kw))
            return "templated"

    marked = Marked(Tokenizer())
    assert marked.apply_chat_template(raw_prompt("as is"), add_generation_prompt=True) == "as is"
    assert not seen  # no template for a raw prompt
    tools = [{"type": "function", "function": {"name": "f"}}]
    calls = json.dumps([{"id": "c", "function": {"name": "f", "arguments": {}}}])
    messages = [tools_message(tools), {"role": "assistant", "content": "", "tool_calls": calls}]
    assert marked.apply_chat_template(messages, tokenize=False) == "templated"
    ((given, kw),) = seen
    assert kw == {"tokenize": False, "tools": tools}
    assert given == [{"role": "assistant", "content": "", "tool_calls": json.loads(calls)}]
