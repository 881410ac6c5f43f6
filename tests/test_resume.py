"""Save and resume: every turn in the store, the KV cache kept by the disk tier.

/save and quitting write the session's KV to the disk tier and persist its tree; a
resumed session's next turn loads it, each file checked. Chats run as a user runs them
(`python -m exokv chat` in a subprocess, script mode with --json, EXOKV_HOME in a
temporary directory); the tier's save also runs in process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import home_with_models

from exokv.rank import kvsave

pytestmark = pytest.mark.timeout(180)

TURNS = ["Hello, who are you?", "Tell me about the sea.", "Why is the sky blue?"]
NEXT = "And what about the mountains?"


@pytest.fixture(scope="session")
def models(models_dir: Path) -> Path:
    return models_dir


def chat(
    home: Path, lines: list[str], *args: str, max_tokens: int = 12
) -> tuple[list[dict[str, Any]], str]:
    """Script mode with --json: (the turn objects, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "EXOKV_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "--json"]
        + ["--max-tokens", str(max_tokens), *args],
        input=("\n".join(lines) + "\n").encode(),
        capture_output=True,
        env={**env, "EXOKV_HOME": str(home)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    docs = [json.loads(x) for x in proc.stdout.decode().splitlines() if x.strip()]
    return [d for d in docs if "turn" in d], proc.stderr.decode()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, models: Path) -> dict[str, Any]:
    """The four turns in one process, with the cache and with --no-cache."""
    warm, _ = chat(
        home_with_models(tmp_path_factory.mktemp("warm"), models, link=True),
        [*TURNS, NEXT],
        "--session",
        "demo",
    )
    cold, _ = chat(
        home_with_models(tmp_path_factory.mktemp("cold"), models),
        [*TURNS, NEXT],
        "--session",
        "demo",
        "--no-cache",
    )
    assert [t["reply"] for t in warm] == [t["reply"] for t in cold]
    return {"warm": warm, "cold": cold}


@pytest.fixture(scope="module")
def three_turns(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Path:
    """A home where `--session demo` ran three turns and quit (its KV cache saved)."""
    home = home_with_models(tmp_path_factory.mktemp("three"), models)
    turns, err = chat(home, TURNS, "--session", "demo")
    assert len(turns) == 3 and "warning" not in err
    assert len(list(home.glob("kv/*/*/rank0/tree.json"))) == 1
    return home


def copy_home(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


@pytest.mark.slow
def test_resume_with_the_saved_cache(three_turns: Path, reference, tmp_path: Path) -> None:
    home = copy_home(three_turns, tmp_path / "home")
    (turn,), err = chat(home, [NEXT], "--session", "demo")
    assert "warning" not in err
    warm4 = reference["warm"][3]
    third = reference["warm"][2]
    # The history is there: the prompt is the whole conversation, rendered as before.
    assert turn["turn"] == 4
    assert turn["prompt_tokens"] == warm4["prompt_tokens"]
    assert turn["reply"] == reference["cold"][3]["reply"]
    # ...and the saved cache covers all of it: as if the chat had never stopped.
    assert turn["cached_tokens"] == warm4["cached_tokens"]
    assert turn["cached_tokens"] >= third["prompt_tokens"] + third["generated_tokens"] - 1
    assert turn["prefilled_tokens"] == turn["prompt_tokens"] - turn["cached_tokens"]
    with sqlite3.connect(home / "exokv.db") as db:
        roles = db.execute(
            "SELECT m.role FROM messages m JOIN sessions s ON s.id = m.session_id "
            "WHERE s.name = 'demo' ORDER BY m.position"
        ).fetchall()
    assert [r[0] for r in roles] == ["user", "assistant"] * 4


def _flip_data_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _tier(home: Path) -> Path:
    (tree,) = home.glob("kv/*/*/rank0/tree.json")
    return tree.parent


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "what", "why"),
    [
        (_flip_data_bytes, "*.kv", "unreadable"),
        (_truncate, "*.kv", "unreadable"),
        (_garbage, "*.kv", "unreadable"),
        (_garbage, "tree.json", "starting cold"),
    ],
    ids=["flipped-bytes", "truncated", "garbage", "garbage-tree"],
)
def test_a_bad_saved_cache_is_reported_and_ignored(
    three_turns: Path, reference, tmp_path: Path, damage, what: str, why: str
) -> None:
    home = copy_home(three_turns, tmp_path / "home")
    # The tree beside rank 0's lock; the KV files in the pool beside its folder.
    where = _tier(home) if what == "tree.json" else _tier(home).parent
    for path in where.glob(what if what == "tree.json" else f"pool-*/{what}"):
        damage(path)
    (turn,), err = chat(home, [NEXT], "--session", "demo")
    said = [line for line in err.splitlines() if why in line]
    assert len(said) == 1, err
    assert "Traceback" not in err
    if what == "*.kv":
        assert "prefilled again" in said[0] and str(_tier(home).parent) in said[0]
    # A correct cold turn: nothing came from the bad files.
    assert turn["cached_tokens"] == 0
    assert turn["prompt_tokens"] == reference["cold"][3]["prompt_tokens"]
    assert turn["reply"] == reference["cold"][3]["reply"]
    # Quitting saved a good cache over the bad one: the next chat is warm again.
    (again,), err = chat(home, ["/undo", NEXT], "--session", "demo")
    assert "warning" not in err and "starting cold" not in err
    assert again["cached_tokens"] >= reference["warm"][2]["prompt_tokens"]
    assert again["reply"] == reference["cold"][3]["reply"]


def _demo_chat(home: Path) -> subprocess.Popen:
    """`--session demo` in script mode with --json, its stdin and stdout piped."""
    env = {k: v for k, v in os.environ.items() if k != "EXOKV_DEBUG"}
    return subprocess.Popen(
        [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "--json"]
        + ["--max-tokens", "12", "--session", "demo"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, "EXOKV_HOME": str(home)},
    )


@pytest.mark.slow
def test_save_then_sigkill_resumes_warm(models: Path, tmp_path: Path, reference) -> None:
    """/save is the crash-safe point: a chat killed after it resumes from the disk tier."""
    home = home_with_models(tmp_path / "home", models, link=True)
    proc = _demo_chat(home)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for line in [*TURNS, "/save"]:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
            last = json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert last["command"] == "/save" and last["ok"] is True, last
    assert "saved the KV cache of 'demo'" in last["message"]
    (turn,), err = chat(home, [NEXT], "--session", "demo")
    assert "warning" not in err and "starting cold" not in err
    assert turn["cached_tokens"] == reference["warm"][3]["cached_tokens"]
    assert turn["reply"] == reference["cold"][3]["reply"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
def test_sigterm_or_sighup_end_the_chat_like_quit(
    models: Path, tmp_path: Path, reference, sig: int
) -> None:
    """`kill` or a closed terminal: one line, exit 128+N, and the KV cache reaches the disk
    tier on the way out, so the next chat resumes warm."""
    home = home_with_models(tmp_path / "home", models, link=True)
    proc = _demo_chat(home)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        for line in TURNS:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
            json.loads(proc.stdout.readline())
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        err = proc.stderr.read().decode()
    finally:
        proc.kill()
    name = signal.Signals(sig).name
    assert code == 128 + sig and err.strip().splitlines() == [
        f"exokv: terminated by {name}; the conversation and its KV cache are kept"
    ], err
    (turn,), err = chat(home, [NEXT], "--session", "demo")
    assert "warning" not in err and "starting cold" not in err
    assert turn["cached_tokens"] == reference["warm"][3]["cached_tokens"]
    assert turn["reply"] == reference["cold"][3]["reply"]


@pytest.mark.slow
def test_sigkill_after_turn_two_keeps_turns_one_and_two(
    models: Path, tmp_path: Path, reference
) -> None:
    home = home_with_models(tmp_path / "home", models, link=True)
    proc = _demo_chat(home)
    assert proc.stdin is not None and proc.stdout is not None
    done = []
    try:
        for line in TURNS[:2]:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
            done.append(json.loads(proc.stdout.readline()))
        # Turn 3 starts (a long line: seconds of prefill) and the process dies mid-turn.
        long_line = " ".join(f"pebble {i} lantern" for i in range(800))
        proc.stdin.write(long_line.encode() + b"\n")
        proc.stdin.flush()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert [d["reply"] for d in done] == [t["reply"] for t in reference["cold"][:2]]

    with sqlite3.connect(home / "exokv.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    from exokv.state import Store

    with Store.open(home) as store:
        messages = store.load_messages("demo")
        row = next(s for s in store.sessions() if s["name"] == "demo")
    assert messages == [
        {"role": "user", "content": TURNS[0]},
        {"role": "assistant", "content": done[0]["reply"]},
        {"role": "user", "content": TURNS[1]},
        {"role": "assistant", "content": done[1]["reply"]},
    ]
    assert row["turns"] == 2

    # The conversation goes on where it stopped, as if the process had never died.
    (turn3,), err = chat(home, [TURNS[2]], "--session", "demo")
    assert "warning" not in err
    assert turn3["turn"] == 3
    assert turn3["prompt_tokens"] == reference["cold"][2]["prompt_tokens"]
    assert turn3["reply"] == reference["cold"][2]["reply"]


# -- in process: the engine's stop during prefill, kvsave's checks ----------------------------


@pytest.fixture(scope="module")
def engine(models: Path):
    """A factory of engines on builtin:tiny: `engine(**EngineOptions fields)`."""
    from exokv.model.resolve import load_model
    from exokv.rank.engine import Engine, EngineOptions

    old = os.environ.get("EXOKV_HOME")
    os.environ["EXOKV_HOME"] = str(models.parent)
    try:
        model, tokenizer = load_model("builtin:tiny")
    finally:
        if old is None:
            del os.environ["EXOKV_HOME"]
        else:
            os.environ["EXOKV_HOME"] = old
    return lambda **options: Engine(model, tokenizer, options=EngineOptions(**options))


def _long_prompt() -> list[dict[str, str]]:
    text = " ".join(f"stone {i} river light" for i in range(130))  # ~1,100 tokens
    return [{"role": "user", "content": text}]


def test_stop_during_prefill_keeps_the_cache_consistent(engine) -> None:
    from exokv.core.records import TurnRequest
    from exokv.rank.engine import PREFILL_STEP

    warm, cold = engine(), engine()
    messages = _long_prompt()
    calls = []

    def progress(done: int, total: int) -> None:
        calls.append(done)

    request = TurnRequest("s", messages, max_tokens=8)
    stopped = warm.turn(request, on_progress=progress, should_stop=lambda: len(calls) >= 2)
    assert stopped.finish_reason == "interrupted"
    assert stopped.reply == "" and stopped.generated_tokens == 0
    assert stopped.prompt_tokens > 2 * PREFILL_STEP
    # The step prefilled before the stop (sized by time: exokv.rank.pace) is kept and
    # serves the next attempt.
    again = warm.turn(request)
    assert 0 < again.cached_tokens == calls[-1] < PREFILL_STEP
    base = cold.turn(TurnRequest("s", messages, max_tokens=8, use_cache=False))
    assert again.reply == base.reply


@pytest.mark.slow
def test_controller_drops_an_exchange_stopped_before_its_first_token(engine) -> None:
    from exokv.chat.conversation import ChatController, TurnSettings

    class Client:
        def __init__(self) -> None:
            self.engine = engine()
            self.stop_now = False

        def turn(self, request, on_text=None, on_progress=None):
            return self.engine.turn(request, on_text, on_progress, lambda: self.stop_now)

    client = Client()
    chat = ChatController(client, TurnSettings(max_tokens=6), "s")
    first = chat.handle("Hello, who are you?")
    assert first is not None and first.result is not None
    client.stop_now = True
    stopped = chat.handle(_long_prompt()[0]["content"])
    assert stopped is not None and stopped.result is None and "nothing kept" in stopped.message
    assert len(chat.current.messages) == 2
    # A /retry that fails (say a rank died) gives the reply it was replacing back.
    client.engine = None
    with pytest.raises(AttributeError):
        chat.handle("/retry")
    assert chat.current.messages[1]["content"] == first.result.reply
    assert len(chat.current.messages) == 2


def test_save_writes_the_path_to_disk_and_keeps_it_in_ram(engine, tmp_path: Path) -> None:
    from exokv.core.records import TurnRequest

    tier = {"disk_dir": str(tmp_path / "tier"), "disk_budget": 1 << 30}
    e = engine(**tier)
    conv = [{"role": "user", "content": "Hello, who are you?"}]
    result = e.turn(TurnRequest("s", conv, max_tokens=10))
    conv += [{"role": "assistant", "content": result.reply}]
    ram = e.cache.total_bytes
    report = kvsave.save_session(e, "s", conv)
    assert report.warning is None and report.skipped is None
    assert report.tokens == result.prompt_tokens + result.generated_tokens  # all it holds
    assert report.bytes[0] == ram  # what it wrote is what RAM holds, and RAM still holds it
    assert e.cache.total_bytes == ram
    assert all(n.payload.tier == "ram" for n in e.cache.tree.nodes())
    held = kvsave.on_disk(e, "s", conv)
    assert held.tokens == report.tokens and not held.on_disk  # saved, and still in RAM
    pool = e.coord.tier.store.pool  # the files, beside the tier's own folder
    assert (tmp_path / "tier" / "tree.json").is_file() and list(pool.glob("*.kv"))
    written = {p.name: p.stat().st_mtime_ns for p in pool.glob("*.kv")}

    # Evicting a saved node is a spill with nothing more to write.
    nxt = conv + [{"role": "user", "content": "More."}]
    e.coord.budget = 0
    e.turn(TurnRequest("other", [{"role": "user", "content": "Another thing."}], max_tokens=4))
    assert e.coord.tier.spills >= 1
    for name, mtime in written.items():
        assert (pool / name).stat().st_mtime_ns == mtime

    # A new engine on the same directory (this one never closed, as if killed) is warm.
    e.coord.tier.store.flush()
    e.coord.tier.store.release()
    fresh = engine(**tier)
    fresh.remember_replies([(result.reply, e.reply_tokens(result.reply))])
    found = kvsave.on_disk(fresh, "s", nxt)
    assert found.tokens == report.tokens and found.on_disk  # a new process: all on disk
    turn = fresh.turn(TurnRequest("s", nxt, max_tokens=10))
    assert turn.cached_tokens == report.tokens
    cold = engine()
    cold.remember_replies([(result.reply, e.reply_tokens(result.reply))])
    assert turn.reply == cold.turn(TurnRequest("s", nxt, max_tokens=10, use_cache=False)).reply

    # Without a disk tier there is one way less to keep KV: /save says so.
    off = kvsave.save_session(cold, "s", conv)
    assert off.tokens == 0 and off.skipped == kvsave.TIER_OFF


def test_save_and_resume_count_the_conversations_tokens_alike(engine, tmp_path: Path) -> None:
    """After /undo the tree still holds the undone turn past the conversation: /save
    counted those too (222 for a 218-token conversation), resuming did not."""
    from exokv.core.records import TurnRequest

    e = engine(disk_dir=str(tmp_path / "tier"), disk_budget=1 << 30)
    conv = [{"role": "user", "content": "Hello, who are you?"}]
    first = e.turn(TurnRequest("s", conv, max_tokens=10))
    conv += [{"role": "assistant", "content": first.reply}]
    undone = [*conv, {"role": "user", "content": "And what is the weather like today?"}]
    e.turn(TurnRequest("s", undone, max_tokens=10))
    # /undo: the conversation is the first exchange again; the tree keeps the second.
    saved = kvsave.save_session(e, "s", conv)
    held = kvsave.on_disk(e, "s", conv)
    assert saved.warning is None and saved.tokens > 0
    assert saved.tokens == held.tokens == e.cache.tree.match(e.render(conv)).length
    assert saved.tokens <= len(e.render(conv))
