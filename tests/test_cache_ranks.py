"""Two ranks with uneven budgets and uneven layers (every layer a sliding window under
--max-kv-size, and the zoo's families of every cache kind): each rank within its
budget after every turn, the same evictions on both, and every rank's bytes as the
others compute them equal to what it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from chat_helpers import cache_json, home_with_models
from test_cluster import rank_log, replies, run_script
from zoo_helpers import LONG_MESSAGE, zoo_models

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

# Four conversations sharing their start: each new one splits the tree's edges.
SCRIPT = [
    "Hello there, tell me about cats",
    "And dogs?",
    "/new b",
    "Hello there, tell me about the sea",
    "/new c",
    "Hello there, tell me about winter",
    "Shorter please",
    "/new d",
    "Hello there, tell me about rivers",
    "/switch b",
    "Thanks",
]
# (model, extra flags, budgets per rank): rank 1 holds one layer of four, with the
# tighter budget, so its budget drives the evictions.
CASES = {
    "max-kv-size": ("builtin:tiny", ("--max-kv-size", "48"), (200_000, 16_000)),
    "gemma3": ("builtin:gemma3-tiny", (), (200_000, 24_000)),
    "gpt-oss": ("builtin:gpt-oss-tiny", (), (200_000, 24_000)),
    "qwen3-next": ("builtin:qwen3-next-tiny", (), (200_000, 24_000)),
    "deepseek-v3": ("builtin:deepseek-v3-tiny", (), (200_000, 10_000)),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_stay_within_uneven_budgets_with_exact_figures(
    case: str, tmp_path: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model, extra, budgets = CASES[case]
    models = models_dir if model == "builtin:tiny" else zoo_models(tmp_path_factory)
    home = home_with_models(tmp_path / "two", models, link=True)
    env = {"EXOKV_RANK_LOG": "1", "EXOKV_TEST_FAKE_PRESSURE": "0.3"}
    args = _two_ranks(CASES[case], 27510 + 10 * list(CASES).index(case))
    turns = run_script(home, SCRIPT, *args, env=env)
    if not extra:  # --max-kv-size: a rotating cache's replies depend on the chunking
        # Under the budgets, evictions and cuts included, the same replies as no cache.
        assert replies(turns) == _plain(SCRIPT, model, extra, models, tmp_path_factory)
    logs = [rank_log(home, 0), rank_log(home, 1)]
    assert len(logs[0]) == len(logs[1]) == len(turns) == 7

    own = _within_budgets_alike(logs, budgets)

    evictions = [e for t in logs[0] for e in t["events"] if e["kind"] == "evict"]
    # Rank 1's small budget drives them all (when one conversation alone is over it,
    # the tree keeps the longest prefix of it that fits, and says so).
    reasons = {e["reason"] for e in evictions}
    assert "budget rank 1" in reasons
    assert all(r == "budget rank 1" or r.startswith("over budget: kept ") for r in reasons)
    assert sum(1 for t in logs[0] for e in t["events"] if e["kind"] == "update") > 0  # splits
    assert any(t["cached_tokens"] > 0 for t in turns)

    # The figures the store keeps (and `exokv cache pressure` shows) are the ranks' own.
    pressure = cache_json(home, "pressure")
    rows = pressure if isinstance(pressure, list) else pressure.get("ranks", pressure)
    last = {r["rank"]: r["cache_bytes"] for r in rows}
    assert last == {0: logs[0][-1]["rank_stats"][0]["cache_bytes"], 1: own[1]}


def _two_ranks(case: tuple[str, tuple[str, ...], tuple[int, int]], port: int) -> tuple[str, ...]:
    """The chat's flags for a case: two ranks split 3,1, the case's budgets."""
    model, extra, budgets = case
    return (
        *("--model", model, "-n", "2", "--split", "3,1", *extra),
        *("--cache-budget", ",".join(str(b) for b in budgets)),
        *("--disk-budget", "0"),  # RAM evictions are what these tests are about
        *("--starting-port", str(port)),
    )


def _within_budgets_alike(logs: list[list[dict]], budgets: tuple[int, int]) -> list[int]:
    """Check both ranks' records of every turn; returns the last turn's bytes per rank."""
    own: list[int] = []
    for t0, t1 in zip(*logs, strict=True):
        own = [t0["rank_stats"][0]["cache_bytes"], t1["rank_stats"][1]["cache_bytes"]]
        # After every turn each rank holds at most its budget ...
        assert all(b <= budget for b, budget in zip(own, budgets, strict=True)), own
        # ... and what each rank computes the other holds is what that rank holds.
        assert t1["rank_stats"][0]["cache_bytes"] == own[0]
        assert t0["rank_stats"][1]["cache_bytes"] == own[1]
        assert t0["events"] == t1["events"]  # every decision alike, evictions included
        assert t0["collectives"]["gather"] == 1  # still one gather per turn
    return own


# Two conversations, the second retried. Rank 1's budget holds one conversation but
# not both: the first is evicted (partly) for the second, never the retried prompt.
RETRY_SCRIPT = ["/new a", LONG_MESSAGE, "/new b", "Then: " + LONG_MESSAGE, "/retry"]
RETRY_CASES = {
    "max-kv-size": ("builtin:tiny", ("--max-kv-size", "48"), (200_000, 20_000)),
    "gemma3": ("builtin:gemma3-tiny", (), (200_000, 16_000)),
    "qwen3-next": ("builtin:qwen3-next-tiny", (), (200_000, 22_000)),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(RETRY_CASES))
def test_retry_after_a_long_message_is_served_whole_on_uneven_ranks_and_budgets(
    case: str, tmp_path: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The point a turn stores at its prompt's end (sliding windows, --max-kv-size,
    states) serves /retry on two uneven ranks as on one, counted in each rank's budget."""
    model, extra, budgets = RETRY_CASES[case]
    models = models_dir if model == "builtin:tiny" else zoo_models(tmp_path_factory)
    home = home_with_models(tmp_path / "two", models, link=True)
    args = _two_ranks(RETRY_CASES[case], 27610 + 10 * list(RETRY_CASES).index(case))
    turns = run_script(home, RETRY_SCRIPT, *args, env={"EXOKV_RANK_LOG": "1"})
    # Under --max-kv-size too: past the first window the steps end on the pace's grid
    # (exokv.rank.pace.KEPT_GRID), so a turn from a hit cuts where one from nothing does.
    plain = _plain(RETRY_SCRIPT, model, extra, models, tmp_path_factory)
    assert replies(turns) == plain
    retry = turns[-1]
    assert retry["reply"] == turns[-2]["reply"]
    assert retry["cached_tokens"] == retry["prompt_tokens"] - 1 > 100, retry
    logs = [rank_log(home, 0), rank_log(home, 1)]
    _within_budgets_alike(logs, budgets)
    reasons = [e["reason"] for t in logs[0] for e in t["events"] if e["kind"] == "evict"]
    assert "budget rank 1" in reasons and all(r.startswith("budget rank ") for r in reasons)


# The --no-cache replies of SCRIPT and RETRY_SCRIPT per (model, flags). A model both
# tests need them for runs both scripts in one chat (RETRY_SCRIPT's "b" renamed: SCRIPT
# made one): with no cache a turn's reply depends on its own conversation alone.
_plain_runs: dict[tuple[str, tuple[str, ...], str], list[str]] = {}
_BOTH = {c[:2] for c in CASES.values() if not c[1]} & {c[:2] for c in RETRY_CASES.values()}


def _plain(
    script: list[str],
    model: str,
    extra: tuple[str, ...],
    models: Path,
    factory: pytest.TempPathFactory,
) -> list[str]:
    name = "budget" if script is SCRIPT else "retry"
    if (model, extra, name) not in _plain_runs:
        parts = [("budget", SCRIPT), ("retry", RETRY_SCRIPT)]
        if (model, extra) not in _BOTH:
            parts = [(name, script)]
        else:
            parts[1] = ("retry", ["/new b2" if x == "/new b" else x for x in RETRY_SCRIPT])
        home = home_with_models(factory.mktemp("plain"), models, link=True)
        lines = [x for _, part in parts for x in part]
        got = replies(run_script(home, lines, "--model", model, "--no-cache", *extra))
        for part_name, part in parts:
            count = sum(1 for x in part if not x.startswith("/") or x == "/retry")
            _plain_runs[model, extra, part_name], got = got[:count], got[count:]
        assert got == []
    return _plain_runs[model, extra, name]


@pytest.mark.timeout(240)
def test_quantized_kv_on_two_pipeline_ranks_hits_as_one_rank(tmp_path, models_dir):
    """--kv-bits on two ranks: mlx-lm's pipeline makes a stage's quantized cache depend on
    its send, which turns its (weights, scales, biases) into a list; a hit on it must
    rebuild it all the same (it failed on rank 1 with a TypeError in concatenate)."""
    import json

    from chat_helpers import run_exokv

    script = "Hello there\nAnd more?\n/undo\nAnd more?\n"
    args = ["chat", "--model", "builtin:small", "--json", "--max-tokens", "8"]
    args += ["--kv-bits", "8", "--kv-group-size", "32"]

    def turns(home: Path, *extra: str) -> list[dict]:
        proc = run_exokv([*args, *extra], home, script)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        docs = [json.loads(x) for x in proc.stdout.decode().splitlines() if x.strip()]
        return [d for d in docs if "turn" in d]

    one = turns(home_with_models(tmp_path / "one", models_dir, link=True))
    two = turns(
        home_with_models(tmp_path / "two", models_dir, link=True),
        *("-n", "2", "--restarts", "0", "--starting-port", "27330"),
    )
    assert [t["reply"] for t in two] == [t["reply"] for t in one]
    assert [t["cached_tokens"] for t in two] == [t["cached_tokens"] for t in one]
    assert two[-1]["cached_tokens"] > 0
