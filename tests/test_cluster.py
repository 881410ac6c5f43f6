"""Distributed chat on localhost: ranks started by mlx.launch, cache decisions that agree.

The chats run `exokv chat` as a user would, on builtin:tiny with short replies.
Each multi-rank test has its own --starting-port so tests never share a ring.
EXOKV_RANK_LOG=1 makes every rank write its own record of each turn (its cache
events and the collectives it took part in) to EXOKV_HOME/ranks/rank-<R>.jsonl.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from chat_helpers import SCRIPT, Chat, home_with_models

from exokv.client.cluster import ClusterClient
from exokv.config import FORWARDED_ENV
from exokv.core.options import parse_split
from exokv.core.records import TurnRequest
from exokv.errors import UsageError
from exokv.frontend.start import ChatOptions, validate
from exokv.hosts.hostfile import parse_hosts, read_hostfile
from exokv.launch.command import plan_launch
from exokv.launch.supervise import diagnose

# Three sessions, so entries pile up and the small budget on rank 1 must evict.
SESSIONS_SCRIPT = [
    "Hello there",
    "Tell me about cats",
    "/new b",
    "Why is the sky blue",
    "And the sea?",
    "/new c",
    "A poem about winter",
    "Shorter please",
    "/switch b",
    "Thanks",
]


# -- helpers -------------------------------------------------------------------------


def run_script(home: Path, lines: list[str], *args: str, **kw: Any) -> list[dict[str, Any]]:
    chat = Chat(home, *args, **kw)
    docs = [chat.send(line) for line in lines]
    code, err = chat.finish()
    assert code == 0, err
    assert chat.leftovers() == []
    return [d for d in docs if "turn" in d]


def rank_log(home: Path, rank: int) -> list[dict[str, Any]]:
    path = home / "ranks" / f"rank-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def replies(turns: list[dict[str, Any]]) -> list[str]:
    return [t["reply"] for t in turns]


# -- launching: command lines and bad input (no ranks started) ----------------------


def test_plan_local_ranks_use_mlx_launch_on_loopback() -> None:
    plan = plan_launch(["python", "-m", "exokv.rank.main"], ranks=3, starting_port=25000)
    argv = plan.argv
    assert Path(argv[0]).name == "exokv-launch"  # mlx.launch, paced (exokv.launch.paced)
    assert argv[argv.index("-n") + 1] == "3"
    assert argv[argv.index("--starting-port") + 1] == "25000"
    assert argv[argv.index("--") + 1 :] == ["python", "-m", "exokv.rank.main"]
    assert plan.local and plan.bind_host == "127.0.0.1" and plan.ranks == 3
    assert not any("--env" == a for a in argv), "local ranks inherit the environment"


def test_plan_remote_hosts_forward_settings_not_secrets(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(
        json.dumps(
            {"hosts": [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]}
        )
    )
    plan = plan_launch(
        ["py"], hosts=read_hostfile(hostfile), env={"EXOKV_TEST_FAKE_PRESSURE": "0.5", "X": "1"}
    )
    assert plan.ranks == 2 and not plan.local and plan.bind_host != "0.0.0.0"
    assert "EXOKV_TEST_FAKE_PRESSURE=0.5" in plan.argv
    assert not any("X=1" == a or "TOKEN" in a for a in plan.argv)
    assert set(FORWARDED_ENV) >= {"EXOKV_TEST_FAKE_PRESSURE"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not valid JSON"),
        ("[]", "non-empty list of hosts"),
        ('{"hosts": [{"ips": ["10.0.0.1"]}]}', 'needs an "ssh" name'),
        ('[{"ssh": "a", "ips": ["not-an-ip"]}]', "not IPs"),
    ],
)
def test_bad_hostfile_is_one_line_usage_error(tmp_path: Path, content: str, message: str) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(content)
    with pytest.raises(UsageError, match=message) as err:
        read_hostfile(hostfile)
    assert "\n" not in str(err.value)


def test_bad_launch_options_fail_before_launching(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        read_hostfile(str(tmp_path / "missing.json"))
    with pytest.raises(UsageError, match="has no IP address"):
        plan_launch(["py"], hosts=parse_hosts("mac1,mac2"), backend="ring")
    with pytest.raises(UsageError, match="not both"):
        validate(ChatOptions(model="builtin:tiny", ranks=2, hosts="10.0.0.1,10.0.0.2"))
    with pytest.raises(UsageError):
        parse_split("3,x")
    with pytest.raises(UsageError):
        parse_split("4,0")
    assert parse_split("3,1") == [3, 1]


def test_unreachable_host_fails_before_launching(monkeypatch) -> None:
    import threading

    from exokv.errors import ExokvError
    from exokv.launch import command as launch

    sshd = socket.create_server(("127.0.0.1", 0))  # greets like an ssh server

    def greet() -> None:
        conn, _ = sshd.accept()
        conn.sendall(b"SSH-2.0-test\r\n")
        conn.close()

    threading.Thread(target=greet, daemon=True).start()
    with socket.socket() as s:  # a port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    ports = {"10.0.0.1": sshd.getsockname()[1], "10.0.0.2": closed}
    monkeypatch.setattr(launch, "ssh_target", lambda name: ("127.0.0.1", ports[name]))
    plan = plan_launch(["py"], hosts=parse_hosts("10.0.0.1,10.0.0.2"), starting_port=25000)
    with pytest.raises(ExokvError, match="rank 1's host '10.0.0.2' cannot be reached over ssh"):
        launch.check_reachable(plan, timeout=2)
    sshd.close()


@pytest.mark.slow
def test_bad_hostfile_from_the_cli(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text("{oops")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "exokv",
            "chat",
            "--model",
            "builtin:tiny",
            "--hostfile",
            str(hostfile),
        ],
        input=b"hi\n",
        capture_output=True,
        timeout=60,
        env={**os.environ, "EXOKV_HOME": str(tmp_path / "home")},
    )
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "hostfile" in lines[0]


def test_diagnose_names_the_rank_that_died_first() -> None:
    lines = [
        "[WARN] Node with rank 1 exited with code -9",
        "[WARN] Node with rank 0 exited with code -15",
    ]
    cause = diagnose(lines, "rank 0 closed the channel")
    assert cause.text.startswith("rank 1 was killed by SIGKILL")
    failed = ['exokv-rank-error {"rank": 1, "message": "model not found"}', *lines[1:]]
    failed.append("[WARN] Node with rank 1 exited with code 1")
    assert diagnose(failed, "x").text == "rank 1 failed: model not found"
    ssh = ["[WARN] Node with rank 1 exited with code 255"]
    assert "ssh failed" in diagnose(ssh, "x", ["10.0.0.1", "mac2"]).text
    assert "mac2" in diagnose(ssh, "x", ["10.0.0.1", "mac2"]).text


def test_a_rank_error_glued_to_other_ranks_text_still_names_the_cause() -> None:
    # mlx.launch relays each rank's output in the pieces it reads: rank 1's error line,
    # its newline in a later piece, had rank 0's watcher's line (and rank 0's own
    # error) glued to it; the cause was lost for "rank 1 exited with code 1".
    cause = "missing file: model-00003-of-00005.safetensors"
    one = json.dumps({"rank": 1, "message": cause})
    zero = json.dumps({"rank": 0, "message": "RuntimeError: [ring] connection to a peer was lost"})
    for glued in (
        f"exokv-rank-error {one}exokv-state 0 running 4242",
        f"[ring] Socket 4 was closed by the peerexokv-rank-error {one}",
        f"exokv-rank-error {one}exokv-rank-error {zero}",
        f"exokv-rank-error {one}[WARN] Node with rank 1 exited with code 1",  # the launcher's
    ):
        lines = [
            "[WARN] Node with rank 1 exited with code 1",
            glued,
            f"exokv-rank-error {zero}",
            "[WARN] Node with rank 0 exited with code 1",
        ]
        assert diagnose(lines, "x").text == f"rank 1 failed: {cause}", glued


def test_a_rank_error_is_one_write_with_its_newline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exokv.rank import boot  # the rank's boot module: only this test needs it

    writes: list[tuple[int, bytes]] = []
    monkeypatch.setattr(boot.os, "write", lambda fd, data: writes.append((fd, data)) or len(data))
    with open(tmp_path / "stderr", "w") as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        boot.report_error(1, RuntimeError("no weights"), None)
        ours = [data for fd, data in writes if fd == stderr.fileno()]
    assert ours == [b'exokv-rank-error {"rank": 1, "message": "RuntimeError: no weights"}\n']


# -- chats on two ranks ----------------------------------------------------------------


@dataclass
class TwoRankRun:
    """SCRIPT on two pipeline ranks in session `s`, then quit: what the chat and the
    ranks said, read before any later chat of this home appends to it."""

    home: Path
    turns: list[dict[str, Any]]
    logs: list[list[dict[str, Any]]]
    trees: list[str]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> TwoRankRun:
    """One two-rank chat for the pipeline test and the resume test (one set of ranks)."""
    home = home_with_models(tmp_path_factory.mktemp("two") / "h", models_dir)
    args = ("-n", "2", "--session", "s", "--starting-port", "25110")
    turns = run_script(home, SCRIPT, *args, env={"EXOKV_RANK_LOG": "1"})
    trees = sorted(p.parent.name for p in (home / "kv").glob("*/*/rank*/tree.json"))
    return TwoRankRun(home, turns, [rank_log(home, 0), rank_log(home, 1)], trees)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_pipeline_matches_one_rank_and_no_cache(
    tmp_path: Path, models_dir: Path, two_rank_run: TwoRankRun
) -> None:
    two = two_rank_run.turns
    one = run_script(home_with_models(tmp_path / "one", models_dir), SCRIPT)
    cold = run_script(home_with_models(tmp_path / "cold", models_dir), SCRIPT, "--no-cache")
    assert replies(two) == replies(one) == replies(cold)
    assert len(set(replies(two))) == len(SCRIPT), "replies must depend on the prompt"
    assert all(t["ranks"] == 2 for t in two)
    assert two[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] > 0 for t in two[1:])
    assert [t["cached_tokens"] for t in two] == [t["cached_tokens"] for t in one]

    # One collective per turn for the cache decision, counted by wrapping the group
    # (exokv.rank.main.CountingGroup) on each rank; one broadcast carries the request.
    for log in two_rank_run.logs:
        assert len(log) == len(SCRIPT)
        assert all(t["collectives"]["gather"] == 1 for t in log), log
        assert all(t["collectives"]["broadcast"] == 1 for t in log)
    logs = two_rank_run.logs
    assert [t["events"] for t in logs[0]] == [t["events"] for t in logs[1]]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensor_parallel_matches_no_cache(tmp_path: Path, models_dir: Path, monkeypatch) -> None:
    # In this process, so each turn runs cached and then without the cache on the same ranks.
    monkeypatch.setenv("EXOKV_HOME", str(home_with_models(tmp_path / "h", models_dir)))
    monkeypatch.delenv("EXOKV_DEBUG", raising=False)
    opts = ChatOptions(
        model="builtin:tiny", ranks=2, parallel="tensor", max_tokens=8, starting_port=25120
    )
    before = set(p.pid for p in psutil.Process().children(recursive=True))
    client = ClusterClient(validate(opts))
    kids = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    messages: list[dict[str, str]] = []
    try:
        for i, line in enumerate(SCRIPT):
            messages.append({"role": "user", "content": line})
            request = TurnRequest("s", list(messages), max_tokens=8)
            hot = client.turn(request)
            cold = client.turn(TurnRequest(**{**request.to_dict(), "use_cache": False}))
            assert hot.reply == cold.reply, f"turn {i + 1}"
            assert cold.cached_tokens == 0 and hot.ranks == 2
            assert (hot.cached_tokens > 0) == (i > 0)
            messages.append({"role": "assistant", "content": hot.reply})
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in kids):
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uneven_budgets_evict_identically_on_every_rank(tmp_path: Path, models_dir: Path) -> None:
    # --split 3,1: rank 0 holds 3 of the 4 layers, so 3x rank 1's bytes per cached
    # token, but may use 1 MB; rank 1 may use only 20 KB. Rank 1 alone is over its
    # budget and drives every eviction; rank 0 must evict the same entries although
    # it has room, or the next turn would prefill from different points.
    home = home_with_models(tmp_path / "two", models_dir)
    env = {"EXOKV_RANK_LOG": "1", "EXOKV_TEST_FAKE_PRESSURE": "0.3"}
    args = ("-n", "2", "--split", "3,1", "--cache-budget", "1MB,20KB", "--disk-budget", "0")
    args += ("--starting-port", "25140")
    two = run_script(home, SESSIONS_SCRIPT, *args, env=env)
    cold = run_script(
        home_with_models(tmp_path / "cold", models_dir), SESSIONS_SCRIPT, "--no-cache"
    )
    assert replies(two) == replies(cold)

    logs = [rank_log(home, 0), rank_log(home, 1)]
    evictions = [
        [
            (t["decision"], e["entry"], e["reason"])
            for t in log
            for e in t["events"]
            if e["kind"] == "evict"
        ]
        for log in logs
    ]
    assert len(evictions[0]) >= 3
    assert evictions[0] == evictions[1], "same entries, same order, same decision ids"
    # Rank 1 drives every eviction; a conversation alone over its budget is cut to the
    # longest prefix that fits (the budget is a cap after every turn).
    reasons = {reason for _, _, reason in evictions[0]}
    assert "budget rank 1" in reasons
    assert all(r == "budget rank 1" or r.startswith("over budget: kept ") for r in reasons)
    # Every event, not just the evictions, is the same on both ranks.
    assert [t["events"] for t in logs[0]] == [t["events"] for t in logs[1]]
    # Rank 0 held more bytes than rank 1 throughout, with room to spare: it evicted
    # only because rank 1 needed it.
    for turn in logs[0]:
        rank0, rank1 = turn["rank_stats"]
        assert rank1["cache_bytes"] < rank0["cache_bytes"] < 1_000_000
    assert sum(t["evictions"] for t in two) == len(evictions[0])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_killing_rank_1_ends_the_chat_cleanly(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "h", models_dir)
    chat = Chat(home, "-n", "2", "--restarts", "0", "--starting-port", "25150")  # no healing
    assert chat.send(SCRIPT[0])["turn"] == 1
    assert chat.send(SCRIPT[1])["turn"] == 2
    chat.rank(1).kill()
    killed = time.monotonic()
    chat.write(SCRIPT[2])
    code, err = chat.finish(timeout=30)
    elapsed = time.monotonic() - killed
    lines = err.strip().splitlines()
    assert code == 1, err
    assert elapsed < 15
    assert len(lines) == 1 and "rank 1" in lines[0] and "killed" in lines[0], err
    assert chat.leftovers() == []


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_resume_loads_every_ranks_saved_shard(two_rank_run: TwoRankRun) -> None:
    # The pipeline test's two-rank chat (session s, quit) is the first run here.
    home, first = two_rank_run.home, two_rank_run.turns
    assert two_rank_run.trees == ["rank0", "rank1"]  # each rank's disk tier, persisted on quit
    args = ("-n", "2", "--session", "s")
    resumed = run_script(home, ["One more thing, please."], *args, "--starting-port", "25190")
    # The whole earlier conversation comes back from the two ranks' tiers, not recomputed.
    assert resumed[0]["cached_tokens"] >= first[-1]["prompt_tokens"]
    assert any(e["kind"] == "load" for e in resumed[0]["events"])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_that_hangs_ends_the_chat_cleanly(tmp_path: Path, models_dir: Path) -> None:
    # A stopped rank 1 (as a Mac gone to sleep) leaves rank 0 blocked in a collective
    # but alive: only rank 1's own missing heartbeat can name it.
    home = home_with_models(tmp_path / "h", models_dir)
    chat = Chat(home, "-n", "2", "--restarts", "0", "--starting-port", "25200")  # no healing
    assert chat.send(SCRIPT[0])["turn"] == 1
    chat.rank(1).suspend()
    stopped = time.monotonic()
    chat.write(SCRIPT[1])
    code, err = chat.finish(timeout=30)
    lines = err.strip().splitlines()
    assert code == 1 and time.monotonic() - stopped < 15, err
    assert len(lines) == 1 and "rank 1 stopped responding" in lines[0], err
    assert chat.leftovers() == []


def test_hostfile_counts_ranks_for_per_rank_budgets(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(
        json.dumps([{"ssh": "mac-a", "ips": ["10.0.0.1"]}, {"ssh": "mac-b", "ips": ["10.0.0.2"]}])
    )
    opts = ChatOptions(model="builtin:tiny", hostfile=str(hostfile), cache_budget="8MB,2MB")
    assert validate(opts).rank_count == 2  # one budget per host: no "2 values for 1 ranks"


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("when", ["starting", "in-the-ring", "idle"])
def test_ranks_end_when_the_front_end_is_killed(
    tmp_path: Path, models_dir: Path, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`in-the-ring`: rank 0 stopped (SIGSTOP, a Mac gone to sleep) as it starts, and
    rank 1 waiting for it in the ring's connect, which holds rank 1's GIL: neither
    rank's own beat thread can notice the front end's end, their watchers can."""
    port = {"starting": "25260", "in-the-ring": "25280", "idle": "25270"}[when]
    temp = tmp_path / "temp"
    temp.mkdir()
    home = home_with_models(tmp_path / "h", models_dir)
    chat = Chat(home, "-n", "2", "--starting-port", port, env={"TMPDIR": str(temp)})
    if when == "idle":
        assert chat.send(SCRIPT[0])["turn"] == 1
    deadline = time.monotonic() + 60
    while len(ranks := _rank_processes(chat)) < 2:
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)
    if when == "in-the-ring":
        while (first := _watched_rank(chat, "0")) is None:
            assert time.monotonic() < deadline, "rank 0 never started its watcher"
            time.sleep(0.05)
        first.suspend()
        time.sleep(4)  # rank 1 imports MLX and reaches the ring
    chat.proc.kill()  # SIGKILL: no chance to stop the launcher, which has its own group
    chat.proc.wait(10)
    _, alive = psutil.wait_procs(ranks, timeout=10)
    # A zombie has ended; only its reaping (init's job, once the front end is gone) waits.
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, "ranks outlived their front end"
    assert chat.leftovers() == []
    # The ranks remove the launcher's folder as they go; the next chat would otherwise.
    from exokv.client.cluster import _sweep_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    _sweep_scratch()
    left = [p.name for p in temp.iterdir() if p.name != "mlx"]  # MLX's own kernel cache
    assert left == [], "the launcher's temporary files were left behind"


def _watched_rank(chat: Chat, rank: str) -> psutil.Process | None:
    """Rank `rank`'s process once it has started its watcher (the launcher's command
    line names exokv.rank.main too; only a rank has MLX_RANK)."""
    for p in _rank_processes(chat):
        try:
            if p.environ().get("MLX_RANK") == rank and any(
                "exokv.launch.watcher" in " ".join(c.cmdline()) for c in p.children()
            ):
                return p
        except psutil.Error:
            continue
    return None


def _rank_processes(chat: Chat) -> list[psutil.Process]:
    chat.note_descendants()
    found = []
    for p in chat.seen.values():
        try:
            if p.is_running() and "exokv.rank.main" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue  # e.g. the launcher's short-lived mktemp, a zombie for an instant
    return found


def test_the_ranks_scratch_folder_shares_mlx_kernel_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' TMPDIR is a folder of the launcher's; MLX's compiled CPU kernels under
    it are the ones every MLX process on this machine keeps, and survive its removal."""
    import shutil

    from exokv.launch.command import make_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scratch = make_scratch()
    assert scratch.parent == tmp_path
    (scratch / "mlx" / "kernel.so").write_bytes(b"compiled")
    shutil.rmtree(scratch)
    assert (tmp_path / "mlx" / "kernel.so").read_bytes() == b"compiled"
    assert not scratch.exists()
