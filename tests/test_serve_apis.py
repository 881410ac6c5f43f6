"""`exokv serve`'s other APIs on one rank, through the real clients: /v1/completions
(`openai`), /v1/messages (`anthropic`), /metrics (parsed by `prometheus_client`)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.chat_helpers import home_with_models
from tests.serve_helpers import MODEL, raw, serving

SYSTEM = "be brief"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path):
    home = home_with_models(tmp_path_factory.mktemp("apis") / "h", models_dir, link=True)
    with serving(home, "--max-tokens", "12") as s:
        yield s


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


# -- /v1/completions ------------------------------------------------------------------


@pytest.mark.slow
def test_completions_stream_and_not_give_the_same_text(server) -> None:
    client = server.client()
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    text = done.choices[0].text
    assert text and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens
    # The prompt is not templated: it is a few tokens, and cached by the second call.
    assert done.usage.prompt_tokens < 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_a_completion_is_not_a_chat(server) -> None:
    """The chat template's text is in the chat's prompt, not in the completion's."""
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=2
    )
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2)
    assert done.usage.prompt_tokens < chat.usage.prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, says",
    [
        ({"prompt": ""}, "prompt must be"),
        ({"prompt": ["a", "b"]}, "one prompt per request"),
        ({"prompt": "a", "echo": True}, "echo is not supported"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens must be between"),
    ],
)
def test_bad_completions_are_400(server, body: dict, says: str) -> None:
    status, _, doc = raw(server.base + "/completions", json.dumps(body).encode())
    assert status == 400 and says in doc["error"]["message"], doc


# -- /v1/messages ---------------------------------------------------------------------


@pytest.mark.slow
def test_messages_equal_the_chat_and_the_second_call_reads_the_cache(server) -> None:
    first = [{"role": "user", "content": "hello there"}]
    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *first],
        max_tokens=12,
        temperature=0,
    )
    done = claude(server).messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=first)
    assert done.type == "message" and done.role == "assistant"
    assert done.content[0].text == chat.choices[0].message.content
    assert done.stop_reason == "max_tokens"
    assert done.usage.output_tokens == 12
    conversation = [
        *first,
        {"role": "assistant", "content": done.content[0].text},
        {"role": "user", "content": [{"type": "text", "text": "tell me more"}]},
    ]
    again = claude(server).messages.create(
        model=MODEL, max_tokens=12, system=SYSTEM, messages=conversation
    )
    used = again.usage
    assert used.cache_read_input_tokens > chat.usage.prompt_tokens  # the whole first exchange
    # The new message was prefilled and stored: created, as Anthropic counts it.
    assert used.cache_creation_input_tokens > 0 and used.input_tokens == 0
    prompt = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *conversation],
        max_tokens=1,
    )
    assert used.cache_read_input_tokens + used.cache_creation_input_tokens == (
        prompt.usage.prompt_tokens
    )


@pytest.mark.slow
def test_count_tokens_is_the_prompt_a_message_call_renders(server) -> None:
    def prompt(used: anthropic.types.Usage) -> int:
        read, created = used.cache_read_input_tokens, used.cache_creation_input_tokens
        return used.input_tokens + (read or 0) + (created or 0)

    first = [{"role": "user", "content": "count me"}]
    counted = claude(server).messages.count_tokens(model=MODEL, system=SYSTEM, messages=first)
    done = claude(server).messages.create(model=MODEL, max_tokens=6, system=SYSTEM, messages=first)
    assert counted.input_tokens == prompt(done.usage) > 0
    # An echoed reply counts as the turn renders it: as the tokens it was generated as.
    conversation = [
        *first,
        {"role": "assistant", "content": done.content[0].text},
        {"role": "user", "content": "and again"},
    ]
    counted = claude(server).messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=conversation
    )
    again = claude(server).messages.create(
        model=MODEL, max_tokens=1, system=SYSTEM, messages=conversation
    )
    assert counted.input_tokens == prompt(again.usage) > prompt(done.usage)
    assert any("POST /v1/messages/count_tokens 200" in x for x in server.log)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(server).messages.count_tokens(
            model=MODEL, messages=[{"role": "assistant", "content": "x"}]
        )
    assert "the last message" in caught.value.body["error"]["message"]


def test_without_the_cache_the_prefill_is_input_not_created() -> None:
    from exokv.core.records import TurnResult
    from exokv.serve.anthropic import usage

    result = TurnResult("s", "r", 30, 0, 30, 4, 0.0, 0.0, 0.0, 1)
    off = usage(result, stored=False)
    assert (off["input_tokens"], off["cache_creation_input_tokens"]) == (30, 0)
    result.cached_tokens, result.prefilled_tokens = 20, 10
    on = usage(result, stored=True)
    assert (on["input_tokens"], on["cache_read_input_tokens"]) == (0, 20)
    assert on["cache_creation_input_tokens"] == 10


@pytest.mark.slow
def test_a_messages_stream_has_anthropics_events_and_the_same_text(server) -> None:
    messages = [{"role": "user", "content": "a stream please"}]
    done = claude(server).messages.create(model=MODEL, max_tokens=10, messages=messages)
    with claude(server).messages.stream(model=MODEL, max_tokens=10, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == done.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    assert final.usage.cache_read_input_tokens > 0  # the same prompt: cached
    body = json.dumps({"max_tokens": 3, "stream": True, "messages": messages}).encode()
    request = urllib.request.Request(server.base + "/messages", data=body)
    with urllib.request.urlopen(request, timeout=60) as resp:
        kinds = [x.decode().split(": ", 1)[1].strip() for x in resp if x.startswith(b"event: ")]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.slow
def test_stop_sequences_end_the_message(server) -> None:
    messages = [{"role": "user", "content": "stop somewhere"}]
    whole = claude(server).messages.create(model=MODEL, max_tokens=12, messages=messages)
    text = whole.content[0].text
    cut = text[len(text) // 2 :][:3]
    done = claude(server).messages.create(
        model=MODEL, max_tokens=12, messages=messages, stop_sequences=[cut]
    )
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == cut
    assert done.content[0].text == text[: text.index(cut)]


@pytest.mark.slow
def test_bad_messages_are_anthropics_errors(server) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(server).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "system", "content": "x"}]
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "role" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude(server).messages.create(
            model="another", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    status, _, doc = raw(server.base + "/messages", b'{"messages": []}')
    assert status == 400 and doc["type"] == "error" and "max_tokens" in doc["error"]["message"]


# -- /metrics -------------------------------------------------------------------------


@pytest.mark.slow
def test_metrics_count_requests_and_tokens_and_show_each_ranks_cache(server) -> None:
    before = metrics(server)
    done = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=5
    )
    after = metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    route = "route=POST /v1/chat/completions,status=200"
    assert grew(f"exokv_requests_total{{{route}}}") == 1
    assert grew("exokv_prompt_tokens_total") == done.usage.prompt_tokens
    assert grew("exokv_completion_tokens_total") == done.usage.completion_tokens
    assert grew("exokv_cached_tokens_total") == done.usage.prompt_tokens_details.cached_tokens
    assert after["exokv_queue_depth"] == 0
    assert after["exokv_requests_in_flight"] == 0
    assert after["exokv_batch_size"] == 1
    assert after["exokv_cache_bytes{rank=0}"] > 0
    assert after["exokv_cache_entries{rank=0}"] >= 1
    assert "exokv_cache_evictions_total{rank=0}" in after or not any(
        k.startswith("exokv_cache_evictions_total") for k in after
    )


@pytest.mark.slow
def test_health_is_ok_on_one_rank(server) -> None:
    status, _, doc = raw(server.url + "/health")
    assert (status, doc["status"]) == (200, "ok")


@pytest.mark.slow
def test_an_unknown_route_is_still_404(server) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client().embeddings.create(model=MODEL, input="x")
