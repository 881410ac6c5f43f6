"""What several benchmark scripts share: the conversation `turns.py` and
`distributed_turns.py` grow, and the two pipeline ranks `real_model_speed.py` and
`speculate.py` compare one rank with.

The scripts run as `python benchmarks/X.py`, which puts this folder on `sys.path`:
they import it as `bench_common`, as some import each other (`from resume import ...`).
"""

from __future__ import annotations

from typing import Any

from exokv.client.cluster import ClusterClient
from exokv.frontend.start import ChatOptions, validate

WORDS = (
    "river stone light window garden paper music winter orange signal harbor "
    "forest bridge candle thunder silver meadow lantern compass feather"
).split()


def user_text(turn: int, words: int) -> str:
    return " ".join(WORDS[(turn * 7 + i * 3) % len(WORDS)] for i in range(words))


def words_per_turn(tokenizer: Any, context: int, turns: int, reply_tokens: int) -> int:
    """The words of each user message for `turns` turns (replies included) to reach
    about `context` tokens."""
    per_turn_tokens = context // turns
    tokens_per_word = len(tokenizer.encode(user_text(0, 200))) / 200
    return max(4, int((per_turn_tokens - reply_tokens - 8) / tokens_per_word))


def pipeline_client(model: str, max_tokens: int, starting_port: int) -> ClusterClient:
    """Two pipeline ranks on this machine, started now (they wait asleep between turns),
    seeded alike and without a disk tier."""
    opts = ChatOptions(
        model=model,
        ranks=2,
        parallel="pipeline",
        max_tokens=max_tokens,
        starting_port=starting_port,
        seed=0,
        disk_budget="0",
    )
    return ClusterClient(validate(opts))
