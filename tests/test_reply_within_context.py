"""A reply's max_tokens beyond what the model's context leaves after the prompt is cut
to it, alike on every path (one turn, a batch's row): the reply ends with "length"."""

from __future__ import annotations

from exokv.core.records import TurnRequest
from exokv.rank.batch import run_batch
from exokv.rank.engine import Engine, EngineOptions, within_context

MESSAGES = [{"role": "user", "content": "Tell me a long story about the sea."}]


def engine(tiny, context: int | None) -> Engine:
    model, tokenizer = tiny
    eng = Engine(model, tokenizer, options=EngineOptions())
    eng.context = context
    return eng


def test_max_tokens_is_cut_to_what_the_context_leaves() -> None:
    request = TurnRequest(session="s", messages=MESSAGES, max_tokens=100)
    assert within_context(request, 20, None) is request
    assert within_context(request, 20, 4096) is request
    assert within_context(request, 20, 50).max_tokens == 30
    assert within_context(request, 50, 50).max_tokens == 1  # the prompt fills it


def test_a_turn_and_a_batch_row_end_at_the_context(tiny) -> None:
    prompt = len(engine(tiny, None).render(MESSAGES))
    request = TurnRequest(session="s", messages=MESSAGES, max_tokens=200)
    alone = engine(tiny, prompt + 7).turn(request)
    assert (alone.generated_tokens, alone.finish_reason) == (7, "length")
    rows = run_batch(engine(tiny, prompt + 5), [request, request])
    for row in rows:
        assert row.result is not None
        assert (row.result.generated_tokens, row.result.finish_reason) == (5, "length")
