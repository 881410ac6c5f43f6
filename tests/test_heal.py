"""A rank that dies is replaced and the chat goes on (-n 2, SIGKILL of the real rank
processes): one line says so, the turn in flight runs again, the next turn is warm
from the disk tiers and journals, and replies equal an uninterrupted run's."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from chat_helpers import Chat, home_with_models
from test_cluster import run_script

LINES = ["Hello there", "Tell me about cats", "And dogs?"]
LONG = ("--max-tokens", "300")  # a reply long enough to be killed in the middle of
SHORT = ("--max-tokens", "40")  # between turns: a reply's length does not matter


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, models_dir: Path):
    home = home_with_models(tmp_path_factory.mktemp("uninterrupted"), models_dir, True)
    return run_script(home, LINES, *SHORT)


def kill(chat: Chat, rank: int) -> None:
    chat.note_descendants()
    chat.rank(rank).send_signal(signal.SIGKILL)


def restarts(turn: dict) -> list[dict]:
    return [e for e in turn["events"] if e["kind"] == "restart"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_1_then_rank_0_killed_between_turns(uninterrupted, tmp_path, models_dir):
    home = home_with_models(tmp_path / "h", models_dir, True)
    chat = Chat(home, "-n", "2", *SHORT, "--starting-port", "26750")
    first = chat.send(LINES[0])
    turns = [first]
    for rank, line in ((1, LINES[1]), (0, LINES[2])):
        time.sleep(1.0)  # the turn's files and journal record are written after its reply
        kill(chat, rank)
        time.sleep(3.0)  # the chat sees it at the prompt
        turns.append(chat.send(line))
    code, err = chat.finish()
    assert code == 0, err
    lines = [x for x in err.splitlines() if "killed by SIGKILL" in x]
    assert len(lines) == 2 and "rank 1" in lines[0] and "rank 0" in lines[1], err
    assert [t["reply"] for t in turns] == [t["reply"] for t in uninterrupted]
    for t, ref in zip(turns[1:], uninterrupted[1:], strict=True):
        assert len(restarts(t)) == 1, t["events"]
        assert t["cached_tokens"] == ref["cached_tokens"] > 0  # warm, not a full prefill
        assert any(e["kind"] == "load" for e in t["events"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_1_killed_during_a_turn_runs_it_again(tmp_path, models_dir):
    # A long message: its prefill and reply take seconds, so the kill lands inside.
    lines = [LINES[0], " ".join(["Tell me about cats and dogs and rivers."] * 60)]
    reference = run_script(home_with_models(tmp_path / "ref", models_dir, True), lines, *LONG)
    home = home_with_models(tmp_path / "h", models_dir, True)
    chat = Chat(home, "-n", "2", *LONG, "--starting-port", "26770")
    first = chat.send(lines[0])
    time.sleep(1.0)
    assert chat.proc.stdout is not None
    chat.write(lines[1])
    time.sleep(0.3)  # into the turn
    kill(chat, 1)
    second = json.loads(chat.proc.stdout.readline())
    code, err = chat.finish()
    assert code == 0, err
    assert len(restarts(second)) == 1, second["events"]  # the turn in flight, run again
    assert [first["reply"], second["reply"]] == [t["reply"] for t in reference]
    assert second["cached_tokens"] == reference[1]["cached_tokens"] > 0
    assert len([x for x in err.splitlines() if "rank 1 was killed by SIGKILL" in x]) == 1, err


def test_a_request_run_again_passes_on_only_the_text_not_yet_shown() -> None:
    from exokv.client.heal import ShownOnce

    got: list[str] = []
    shown = ShownOnce(got.append)
    shown.rerun()
    for piece in ["The ", "cat", " sat"]:  # the ranks die after this much
        shown(piece)
    shown.rerun()  # the new ranks stream the same reply from its start
    for piece in ["The c", "at s", "at on", " the mat"]:
        shown(piece)
    assert "".join(got) == "The cat sat on the mat"
    assert got[:3] == ["The ", "cat", " sat"]
    ShownOnce(None)("nothing to pass on")  # a request without a stream
