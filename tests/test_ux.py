"""The command line as people use it: --version, help, completions, one-shot prompts,
sessions that keep their settings, and `exokv sessions ...`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chat_helpers import exokv_text, home_with_models, run_exokv

from exokv import __version__

pytestmark = pytest.mark.timeout(180)

BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_version_and_bare_exokv(tmp_path: Path) -> None:
    for args in (["--version"], ["-V"]):
        proc = run_exokv(args, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.decode().strip() == f"exokv {__version__}"
    bare = run_exokv([], tmp_path)
    assert bare.returncode == 0, bare.stderr
    out = bare.stdout.decode()
    assert "Usage: exokv" in out and "chat" in out and "sessions" in out


@pytest.mark.slow
def test_help_shows_no_type_on_plain_flags(tmp_path: Path) -> None:
    proc = exokv_text(tmp_path, "chat", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--no-cache" in proc.stdout
    assert "<bool>" not in proc.stdout
    assert "<int>" in proc.stdout  # options that take a value still say which


@pytest.mark.slow
@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completions_command_prints_the_shipped_script(tmp_path: Path, shell: str) -> None:
    proc = exokv_text(tmp_path, "completions", shell)
    assert proc.returncode == 0, proc.stderr
    root = Path(__file__).resolve().parent.parent
    assert proc.stdout == (root / "completions" / f"exokv.{shell}").read_text()


@pytest.mark.slow
def test_completions_of_an_unknown_shell_is_a_usage_error(tmp_path: Path) -> None:
    proc = exokv_text(tmp_path, "completions", "ksh")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "exokv: error: no completions for 'ksh': use bash, zsh or fish"
    ]


def _bash_complete(script: Path, words: list[str], home: Path) -> list[str]:
    """Source the script in a real bash and ask it to complete `words` (last is the cursor's)."""
    quoted = " ".join(f"'{w}'" for w in words)
    program = (
        f"source {script}\n"
        f"COMP_WORDS=({quoted})\nCOMP_CWORD={len(words) - 1}\n"
        "_exokv_completion\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    env = {**os.environ, "EXOKV_HOME": str(home), "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [w for w in proc.stdout.splitlines() if w]


@pytest.mark.slow
def test_bash_completes_models_sessions_and_scenarios(tmp_path: Path, models_dir: Path) -> None:
    from exokv.model import BUILTIN_NAMES

    home = home_with_models(tmp_path / "home", models_dir, link=True)
    script = tmp_path / "exokv.bash"
    proc = exokv_text(home, "completions", "bash")
    assert proc.returncode == 0, proc.stderr
    script.write_text(proc.stdout)
    builtins = [f"builtin:{n}" for n in BUILTIN_NAMES]

    got = _bash_complete(script, ["exokv", "chat", "--model", "b"], home)
    assert set(builtins) <= set(got) and all(g.startswith("b") for g in got)
    # `builtin:t` reaches the function as three words; only the part after ':' is replaced.
    got = _bash_complete(script, ["exokv", "chat", "--model", "builtin", ":", "t"], home)
    assert got == ["tiny"]
    assert _bash_complete(script, ["exokv", "bench", "--scenario", "sh"], home) == ["shared-prefix"]
    assert _bash_complete(script, ["exokv", "chat", "--session", ""], home) == []
    made = run_exokv(["chat", "--model", "builtin:tiny", "--max-tokens", "4",
                      "--session", "pasta", "hi"], home)  # fmt: skip
    assert made.returncode == 0, made.stderr.decode()
    assert _bash_complete(script, ["exokv", "chat", "--session", "p"], home) == ["pasta"]
    assert _bash_complete(script, ["exokv", "sessions", "show", ""], home) == ["pasta"]
    assert "--version" in _bash_complete(script, ["exokv", "--"], home)


@pytest.mark.slow
def test_one_shot_prompt_answers_and_exits(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    args = ["chat", "--model", "builtin:tiny", "--max-tokens", "8", "--session", "q"]
    proc = run_exokv([*args, "hi"], home)
    assert proc.returncode == 0, proc.stderr.decode()
    reply = proc.stdout.decode()
    assert reply.endswith("\n") and reply.count("\n") == 1 and reply.strip()
    # --json: the turn's object; --session continues the conversation.
    proc = run_exokv([*args, "--json", "and", "then?"], home)
    assert proc.returncode == 0, proc.stderr.decode()
    doc = json.loads(proc.stdout)
    assert doc["turn"] == 2 and doc["session"] == "q"
    assert doc["cached_tokens"] > 0  # the first turn's KV cache was saved and loaded
    shown = exokv_text(home, "sessions", "show", "q", "--json")
    transcript = json.loads(shown.stdout)["transcript"]
    assert [m["content"] for m in transcript if m["role"] == "user"] == ["hi", "and then?"]
    assert transcript[1]["content"] == reply.rstrip("\n")


@pytest.mark.slow
def test_resume_keeps_model_system_and_max_kv_size(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    env = {"EXOKV_MODEL": ""}  # no default from the environment: the session decides
    first = run_exokv(["chat", "--model", "builtin:tiny", "--system", "Be brief.",
                       "--max-kv-size", "512", "--max-tokens", "4", "--session", "pasta",
                       "hello"], home, env=env)  # fmt: skip
    assert first.returncode == 0, first.stderr.decode()
    again = run_exokv(["chat", "--max-tokens", "4", "--session", "pasta", "--json", "more"],
                      home, env=env)  # fmt: skip
    assert again.returncode == 0, again.stderr.decode()
    err = again.stderr.decode()
    assert "resuming 'pasta' on builtin:tiny" in err and "smollm2" not in err
    assert json.loads(again.stdout)["cached_tokens"] > 0  # its own KV cache was used
    info = json.loads(exokv_text(home, "sessions", "show", "pasta", "--json").stdout)
    stored = (info["model"], info["system"], info["max_kv_size"])
    assert stored == ("builtin:tiny", "Be brief.", 512)


def test_naming_another_model_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from exokv.frontend.resume import resolve
    from exokv.state import Store

    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    with Store.open(tmp_path) as store:
        store.ensure_session("pasta", "builtin:tiny")
    other = resolve("pasta", "builtin:base", None)
    assert other.model == "builtin:base"
    assert "was on builtin:tiny" in other.notes[0]
    kept = resolve("pasta", None, None)
    assert kept.model == "builtin:tiny" and "resuming" in kept.notes[0]
    assert resolve("pasta", "builtin:tiny", None).notes == []


@pytest.mark.slow
def test_sessions_are_made_by_their_first_turn_with_unique_names(
    tmp_path: Path, models_dir: Path
) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    # a, then /new, then b: b goes to a NEW conversation; /new alone leaves no empty one.
    proc = run_exokv(["chat", "--model", "builtin:tiny", "--max-tokens", "4", "--json"], home,
                     "a\n/new\nb\n/new\n/quit\n")  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(x) for x in proc.stdout.decode().splitlines() if '"turn"' in x]
    assert len(turns) == 2 and turns[0]["session"] != turns[1]["session"]
    assert all(t["turn"] == 1 for t in turns)
    listed = json.loads(exokv_text(home, "sessions", "list", "--json").stdout)["sessions"]
    assert sorted(s["name"] for s in listed) == sorted(t["session"] for t in turns)
    assert all(len(s["name"]) <= 12 for s in listed)
    # A chat that only quits leaves nothing behind.
    empty = run_exokv(["chat", "--model", "builtin:tiny"], home, "/quit\n")
    assert empty.returncode == 0, empty.stderr.decode()
    after = json.loads(exokv_text(home, "sessions", "list", "--json").stdout)["sessions"]
    assert len(after) == 2


def test_fresh_names_do_not_collide() -> None:
    from exokv.chat.conversation import fresh_name

    names: set[str] = set()
    for _ in range(500):
        names.add(fresh_name(names))
    assert len(names) == 500


@pytest.mark.slow
def test_sessions_list_show_rename_rm(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    for text in ("first question", "second question"):
        proc = run_exokv(["chat", "--model", "builtin:tiny", "--max-tokens", "4",
                          "--session", "old", text], home)  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode()
    listed = exokv_text(home, "sessions", "list")
    assert listed.returncode == 0 and "old" in listed.stdout and "2" in listed.stdout
    shown = exokv_text(home, "sessions", "show", "old")
    assert "user:" in shown.stdout and "second question" in shown.stdout

    # A session open in a chat (its lock held, as a chat holds it) is not changed.
    from exokv.state.locks import SessionLocks

    held = SessionLocks(home)
    held.acquire("old")
    for args in (("rm", "old"), ("rename", "old", "other")):
        busy = exokv_text(home, "sessions", *args)
        assert busy.returncode == 1, busy.stdout
        assert busy.stderr.strip() == (
            f"exokv: error: session 'old' is open in another exokv chat (pid {os.getpid()})"
            ": quit that chat first"
        )
    held.release_all()

    renamed = exokv_text(home, "sessions", "rename", "old", "new", "--json")
    assert json.loads(renamed.stdout) == {"renamed": "old", "to": "new"}
    assert exokv_text(home, "sessions", "show", "old").returncode == 1
    # The renamed session resumes with its KV cache (on disk, keyed by its tokens).
    proc = run_exokv(["chat", "--max-tokens", "4", "--session", "new", "--json", "third"], home)
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["cached_tokens"] > 0

    clash = exokv_text(home, "sessions", "rename", "new", "new")
    assert clash.returncode == 1 and "exists already" in clash.stderr
    removed = exokv_text(home, "sessions", "rm", "new", "--json")
    assert json.loads(removed.stdout) == {"removed": "new", "messages": 6}
    assert json.loads(exokv_text(home, "sessions", "list", "--json").stdout) == {"sessions": []}
    missing = exokv_text(home, "sessions", "rm", "new")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "exokv: error: no session 'new': `exokv sessions list` shows them"
    )


@pytest.mark.slow
def test_pressure_of_a_rank_the_run_does_not_have_is_a_usage_error(tmp_path: Path) -> None:
    from exokv.core.records import RankStats
    from exokv.state import Store

    with Store.open(tmp_path) as store:
        run = store.start_run("builtin:tiny", 2, [None, None])
        samples = [RankStats(r, 0, 0, None, 0.1, 8_000_000_000, 1, 1) for r in range(2)]
        store.record_samples(run, samples)
    for extra in ([], ["--json"]):
        proc = exokv_text(tmp_path, "cache", "pressure", "--rank", "5", *extra)
        assert proc.returncode == 2, proc.stdout
        assert proc.stderr.strip() == "exokv: error: --rank 5: the current run has 2 ranks (from 0)"
    assert exokv_text(tmp_path, "cache", "pressure", "--rank", "1").returncode == 0


def test_a_v3_database_keeps_its_sessions_and_gains_max_kv_size(tmp_path: Path) -> None:
    import sqlite3

    from exokv.state import Store, db_path
    from exokv.state.schema import MIGRATIONS

    tmp_path.mkdir(exist_ok=True)
    db = sqlite3.connect(db_path(tmp_path), isolation_level=None)
    db.execute("BEGIN")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for migration in MIGRATIONS[:3]:
        migration(db)
    db.execute("INSERT INTO schema_version VALUES (3)")
    db.execute("INSERT INTO sessions VALUES (1, 'old', 'builtin:tiny', 'Be kind.', 1000.0, 1000.0)")
    db.execute("COMMIT")
    db.close()
    with Store.open(tmp_path) as store:
        info = store.session_info("old")
        assert info is not None
        assert (info["model"], info["system"], info["max_kv_size"]) == (
            "builtin:tiny",
            "Be kind.",
            None,
        )
        store.set_session_options("old", 256)
        assert store.session_info("old")["max_kv_size"] == 256


def test_a_busy_session_is_refused_before_resuming_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line, the refusal: not `resuming 'lk' on ...` and then the error."""
    from exokv.cli.app import _settled
    from exokv.frontend import resume
    from exokv.state.locks import SessionBusy, SessionLocks

    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    monkeypatch.setattr(resume, "stored_session", lambda name: {"model": "builtin:tiny"})
    held = SessionLocks(tmp_path)
    held.acquire("lk")
    try:
        with pytest.raises(SessionBusy, match="session 'lk' is open in another exokv chat"):
            _settled("lk", None, None, None)
        assert capsys.readouterr().err == ""
    finally:
        held.release_all()
    assert _settled("lk", None, None, None).model == "builtin:tiny"
    assert capsys.readouterr().err == "exokv: resuming 'lk' on builtin:tiny\n"
