"""`exokv bench`: the whole run on builtin:tiny, its JSON, and its one-line usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exokv.bench import SCENARIOS, STRATEGIES, scenarios

TURN_FIELDS = (
    "prompt_tokens",
    "cached_tokens",
    "prefilled_tokens",
    "generated_tokens",
    "ttft_s",
    "decode_tps",
    "overhead_s",
    "cache_bytes",
    "reply",
)
STRATEGY_FIELDS = ("total_ttft_s", "cached_fraction", "peak_cache_bytes", "median_decode_tps")


def _bench(args: list[str], home: Path, prelude: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    code = prelude + "from exokv.cli.app import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, "bench", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    home = tmp_path_factory.mktemp("home")
    args = ["--model", "builtin:tiny", "--turns", "3", "--context", "200", "--reply-tokens", "8"]
    proc = _bench([*args, "--scenario", "all", "--json"], home)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def bench_doc(bench_run: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(bench_run.stdout)


@pytest.mark.slow
def test_the_time_is_estimated_before_the_run(bench_run: subprocess.CompletedProcess[str]) -> None:
    """One line on stderr before the first measurement (stdout is the JSON alone)."""
    lines = bench_run.stderr.splitlines()
    said = [line for line in lines if line.startswith("exokv: bench: about ")]
    assert len(said) == 1, bench_run.stderr
    # 5 scenarios of 3 turns: linear 3 steps, switch 3*4, branch 6 (a retry, an undo and an
    # edit), shared-prefix 3*8, restart 3*4; each step once per strategy and for the limit.
    assert f"for {57 * 6:,} measured turns" in said[0]


@pytest.mark.slow
def test_the_tables_fit_80_columns_and_never_cut_a_name(bench_doc: dict) -> None:
    from rich.console import Console

    from exokv.bench.report import MISSED_MEANS, print_tables

    console = Console(record=True, width=80, color_system=None)
    print_tables(bench_doc, console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    rows = [line.split()[0] for line in text.splitlines() if line.strip()]
    for name in STRATEGIES:
        assert rows.count(name) >= len(SCENARIOS), name  # whole, in every scenario's table
    assert " ".join(MISSED_MEANS.split()) in " ".join(text.split())  # what missed means


@pytest.mark.slow
def test_json_has_every_field(bench_doc: dict) -> None:
    assert bench_doc["model"] == "builtin:tiny"
    assert bench_doc["strategies"] == list(STRATEGIES)
    assert set(bench_doc["scenarios"]) == set(SCENARIOS)
    for name, s in bench_doc["scenarios"].items():
        assert s["turns"], name
        for strat in STRATEGIES:
            entry = s["strategies"][strat]
            for field in STRATEGY_FIELDS:
                assert field in entry, (name, strat, field)
            assert len(entry["peak_cache_bytes"]) == 1  # one rank
        assert set(s["speedup"]) == set(STRATEGIES) - {"exokv"}
        assert all(v > 0 for v in s["speedup"].values())
        for key in ("total_ttft_s", "cached_fraction", "ideal_cached_fraction"):
            assert key in s["limit"]
        for turn in s["turns"]:
            for key in ("turn", "conversation", "action", "limit_ttft_s", "limit_cached_tokens"):
                assert key in turn
            for strat in STRATEGIES:
                cell = turn["strategies"][strat]
                for field in TURN_FIELDS:
                    assert field in cell, (name, strat, field)
                assert cell["prompt_tokens"] == cell["cached_tokens"] + cell["prefilled_tokens"]
                assert cell["ttft_s"] > 0
    names = {t["name"] for t in bench_doc["targets"]}
    assert {"ttft_vs_limit", "linear_cached_fraction", "linear_vs_cold", "overhead"} <= names
    assert "shared_prefix_bytes" in names


@pytest.mark.slow
def test_the_four_strategies_give_the_same_replies(bench_doc: dict) -> None:
    assert bench_doc["replies_match"], bench_doc["mismatches"]
    for s in bench_doc["scenarios"].values():
        for turn in s["turns"]:
            replies = {turn["strategies"][strat]["reply"] for strat in STRATEGIES}
            assert len(replies) == 1


@pytest.mark.slow
def test_the_caches_do_what_they_claim(bench_doc: dict) -> None:
    scen = bench_doc["scenarios"]
    linear = scen["linear"]
    assert linear["max_prompt_tokens"] >= 180  # the last turn reaches --context
    assert linear["strategies"]["cold"]["cached_fraction"] == 0
    later = linear["turns"][1:]
    assert all(t["strategies"]["exokv"]["cached_tokens"] > 0 for t in later)
    for s in scen.values():
        for turn in s["turns"]:
            # Nothing can serve more than the longest prefix seen before.
            for strat in STRATEGIES:
                assert turn["strategies"][strat]["cached_tokens"] <= turn["limit_cached_tokens"]
            assert turn["limit_cached_tokens"] <= turn["ideal_cached_tokens"]
    actions = [t["action"] for t in scen["branch"]["turns"]]
    assert {"retry", "undo", "edit"} <= set(actions)
    assert len({t["conversation"] for t in scen["switch"]["turns"]}) == 4
    shared = scen["shared-prefix"]
    assert len({t["conversation"] for t in shared["turns"]}) == 8
    exo = shared["strategies"]["exokv"]["peak_cache_bytes"][0]
    assert exo <= 1.3 * shared["ideal_cache_bytes"][0]
    assert exo < shared["strategies"]["mlx-lm-lru"]["peak_cache_bytes"][0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        (["--turns", "0"], "--turns"),
        (["--context", "10"], "--context"),
        (["--scenario", "shared-prefix", "--turns", "4", "--context", "300"], "shared-prefix"),
        (["--scenario", "nope"], "unknown scenario"),
        (["--scenario", "linear,zigzag"], "unknown scenario"),
        (["--repeat", "0"], "--repeat"),
        (["--parallel", "diagonal"], "--parallel"),
        (["--ranks", "0"], "--ranks"),
        (["--ranks", "2", "--starting-port", "70000"], "--starting-port"),
        (["--cache-budget", "lots"], "--cache-budget"),
        (["--cache-budget", "0MB"], "--cache-budget"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str], words: str) -> None:
    proc = _bench(["--model", "builtin:tiny", *args], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("exokv: error:") and words in lines[0]
    assert proc.stdout == ""


@pytest.mark.slow
def test_under_a_cache_budget_exokv_keeps_the_shared_prefix(tmp_path: Path) -> None:
    # shared-prefix on tiny (1 KB a token): a ~220-token system prompt, 8 conversations
    # of 2 turns. 1.3 MB holds the prompt and most conversations' tails once (exokv),
    # not a full copy per conversation (mlx-lm-lru, 300-400 tokens each).
    budget = 1_300_000
    args = ["--model", "builtin:tiny", "--turns", "2", "--context", "400", "--reply-tokens", "8"]
    proc = _bench(
        [*args, "--scenario", "shared-prefix", "--cache-budget", "1300KB", "--json"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["cache_budget"] == budget
    assert doc["cache_budget_strategies"] == ["mlx-lm-lru", "exokv", "exokv+disk"]
    assert "cold and carried are not affected" in doc["cache_budget_note"]
    assert doc["replies_match"], doc["mismatches"]
    s = doc["scenarios"]["shared-prefix"]
    for turn in s["turns"]:
        assert len({turn["strategies"][strat]["reply"] for strat in STRATEGIES}) == 1
    st = s["strategies"]
    for strat in ("mlx-lm-lru", "exokv"):
        # Within what each policy bounds (LRU + active cache at admission; exokv's
        # stored bytes), and the budget did bite.
        assert st[strat]["within_budget"], (strat, st[strat]["over_budget_turns"])
        assert st[strat]["unavoidably_over_budget_turns"] == [], strat
        assert st[strat]["budget_peak_bytes"][0] <= budget, strat
        assert st[strat]["evicted"] > 0, strat
    assert st["exokv"]["peak_cache_bytes"][0] <= budget  # exokv's bound is its stored bytes
    for strat in ("cold", "carried"):
        assert "budget_peak_bytes" not in st[strat]
    # Token counts are deterministic: sharing the prompt keeps more of it cached.
    assert st["exokv"]["cached_fraction"] >= st["mlx-lm-lru"]["cached_fraction"]


@pytest.mark.slow
def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    blocked = "import sys; sys.modules['matplotlib'] = None; "
    args = ["--model", "builtin:tiny", "--turns", "1", "--context", "120", "--plot"]
    proc = _bench([*args, str(tmp_path / "x.png")], tmp_path, blocked)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib" in lines[0] and "pip install" in lines[0]


# -- scenarios, without a model ---------------------------------------------------------


def _render(messages) -> list[int]:
    """A stand-in tokenizer: one token per word, four per message, two for the prompt."""
    out: list[int] = []
    for m in messages:
        out += [1, 2, 3] + [hash(w) % 1000 for w in m["content"].split()] + [4]
    return out + [5, 6]


def _play(name: str, turns: int = 4, context: int = 400, seed: int = 0) -> list:
    scen = scenarios.build(name, turns, context, _render, seed)
    steps = []
    while (step := scen.next_step()) is not None:
        steps.append(step)
        scen.commit(step, f"reply {step.index} " + "word " * 10)
    return steps


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenarios_are_deterministic_and_reach_the_context(name: str) -> None:
    a, b = _play(name), _play(name)
    assert [s.messages for s in a] == [s.messages for s in b]
    assert _play(name, seed=1)[0].messages != a[0].messages
    last = max(len(_render(s.messages)) for s in a)
    assert 360 <= last <= 400


def test_scenario_shapes() -> None:
    assert len(_play("linear")) == 4
    switch = _play("switch")
    assert len(switch) == 16
    assert [s.conversation for s in switch[:4]] == ["chat1", "chat2", "chat3", "chat4"]
    branch = _play("branch")
    assert [s.action for s in branch] == [
        "user", "user", "retry", "user", "undo", "user", "edit",
    ]  # fmt: skip
    retry = branch[2]
    assert retry.messages == branch[1].messages  # the same prompt again
    edit = branch[-1]
    assert len(edit.messages) == 4  # system, user 1, reply 1, the edited user 2
    shared = _play("shared-prefix", turns=2)
    assert len(shared) == 16  # 8 conversations of --turns turns each
    assert [s.conversation for s in shared[:9]] == [f"user{c}" for c in range(1, 9)] + ["user1"]
    systems = {s.messages[0]["content"] for s in shared}
    assert len(systems) == 1 and len(next(iter(systems)).split()) > 100


# -- the estimate and --quick, without a model ------------------------------------------


def test_the_estimate_counts_every_step_at_about_its_prompt() -> None:
    from exokv.bench import estimate

    prompts = estimate.step_prompts(list(SCENARIOS), 4, 400, 0, _render)
    assert len(prompts) == sum(len(_play(name)) for name in SCENARIOS)
    played = [len(_render(s.messages)) for name in SCENARIOS for s in _play(name)]
    # A step's target is what its prompt reaches, about (a retry or an edit: no longer).
    assert all(p <= 400 for p in prompts) and sum(prompts) >= 0.8 * sum(played)
    rates = estimate.Rates(prefill_tps=10_000.0, decode_tps=500.0)
    one = estimate.seconds(prompts, 8, 1, rates)
    steps = len(prompts) * estimate.MEASUREMENTS
    want = estimate.PREFILLS_PER_STEP * sum(prompts) / 10_000 + steps * (8 / 500 + 0.02)
    assert one == pytest.approx(want)
    assert estimate.seconds(prompts, 8, 3, rates) == pytest.approx(3 * one)  # --repeat 3
    said = estimate.say(one, len(prompts), 1, rates)
    assert said.startswith(f"about {round(one)} s for {steps:,} measured turns")
    assert "--quick" not in said  # a short run is not told to be shorter
    assert "--quick runs a short version" in estimate.say(600, len(prompts), 1, rates)


def test_quick_changes_only_the_sizes_not_given() -> None:
    from exokv.cli.bench import QUICK_SIZES, SIZES, _sizes

    assert _sizes(False, None, None, None) == SIZES == (8, 2000, 32)
    assert _sizes(True, None, None, None) == QUICK_SIZES
    assert _sizes(True, 5, None, 16) == (5, QUICK_SIZES[1], 16)
