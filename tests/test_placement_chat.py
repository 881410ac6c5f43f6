"""`--split auto` (the default on several ranks), `--plan` and the refusal, as a user runs
them: two local ranks on builtin:tiny with EXOKV_TEST_HOST_MEMORY playing uneven Macs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from chat_helpers import Chat, Terminal, exokv_text, home_with_models, run_exokv
from test_cluster import replies, run_script

LINES = ["Hello there, tell me a story", "And then what happened?"]
UNEVEN = {"EXOKV_TEST_HOST_MEMORY": "24GB,8GB"}


def _plan_event(turns: list[dict]) -> dict:
    plans = [e for t in turns for e in t["events"] if e["kind"] == "plan"]
    assert len(plans) == 1 and turns[0]["events"][0] is plans[0]  # the first turn's, first
    return plans[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_split_on_uneven_hosts_caches_and_answers_as_one_rank(tmp_path, models_dir):
    one = run_script(home_with_models(tmp_path / "one", models_dir, True), LINES)
    home = home_with_models(tmp_path / "two", models_dir, True)
    chat = Chat(home, "-n", "2", "--starting-port", "31710", env=UNEVEN)
    turns = [chat.send(line) for line in LINES]
    code, err = chat.finish()
    assert code == 0, err
    plan = _plan_event(turns)
    # 24 GB and 8 GB: rank 0 (the last layers) holds three of the four, rank 1 one.
    assert plan["split"] == [3, 1] and plan["source"] == "auto"
    assert [r["layers"] for r in plan["ranks"]] == [[1, 4], [0, 1]]
    budgets = [r["budget"] for r in plan["ranks"]]
    assert budgets[0] > 2 * budgets[1] > 0
    # The ranks run with the planned budgets, and the table said them before loading.
    assert [s["budget"] for s in turns[0]["rank_stats"]] == budgets
    # The planned KV bytes per token are the ones the ranks' cache entries take.
    add = next(e for e in turns[0]["events"] if e["kind"] == "add" and e["tokens"])
    assert add["bytes"] == [add["tokens"] * r["kv_per_token"] for r in plan["ranks"]]
    assert turns[1]["cached_tokens"] > 0
    assert replies(turns) == replies(one)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_given_split_stands_and_the_plan_is_shown_on_a_terminal(tmp_path, models_dir):
    """--split 3,1 where auto would choose 1,3: the ranks run 3,1 and answer as one rank;
    on a terminal the table (budgets included) comes before the ranks load."""
    one = run_script(home_with_models(tmp_path / "one", models_dir, True), LINES[:1])
    home = home_with_models(tmp_path / "two", models_dir, True)
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "-n", "2",
           "--split", "3,1", "--max-tokens", "8", "--starting-port", "31730", LINES[0]]  # fmt: skip
    env = {**os.environ, "EXOKV_HOME": str(home), "EXOKV_TEST_HOST_MEMORY": "8GB,24GB"}
    term = Terminal(cmd, env, stdout=subprocess.PIPE)
    table = term.expect(r"cache budget.*free after")
    term.expect(r"split 3,1 \(as given\)")
    starting = term.expect(r"starting 2 ranks")
    assert table.start() < starting.start()
    assert term.close(timeout=120) == 0, term.text
    assert term.proc.stdout is not None
    assert term.proc.stdout.read().decode().strip() == one[0]["reply"].strip()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plan_prints_and_exits_without_loading(tmp_path, models_dir):
    home = home_with_models(tmp_path / "h", models_dir, True)
    proc = exokv_text(home, "chat", "--model", "builtin:tiny", "-n", "2", "--plan")
    assert proc.returncode == 0, proc.stderr
    assert "cache budget" in proc.stdout and "free after" in proc.stdout
    assert "split 2,2 (placed from memory)" in proc.stdout  # one machine: an even share
    assert not (home / "exokv.db").exists()  # no store opened, no rank started
    env_doc = run_exokv(
        ["chat", "--model", "builtin:tiny", "-n", "2", "--plan", "--json"], home, env=UNEVEN
    )
    assert env_doc.returncode == 0, env_doc.stderr.decode()
    doc = json.loads(env_doc.stdout)  # one JSON document
    assert doc["split"] == [3, 1] and len(doc["ranks"]) == 2
    assert doc["ranks"][1]["memory"] == 8 * 10**9
    flipped = run_exokv(
        ["chat", "--model", "builtin:tiny", "-n", "2", "--plan", "--json"],
        home,
        env={"EXOKV_TEST_HOST_MEMORY": "8GB,24GB"},
    )
    assert json.loads(flipped.stdout)["split"] == [1, 3]
    # A split given stands, whatever the memory says.
    given = run_exokv(
        ["chat", "--model", "builtin:tiny", "-n", "2", "--split", "3,1", "--plan", "--json"],
        home,
        env={"EXOKV_TEST_HOST_MEMORY": "8GB,24GB"},
    )
    doc = json.loads(given.stdout)
    assert doc["split"] == [3, 1] and doc["source"] == "given"
    # --cache-budget replaces the planned budgets.
    fixed = run_exokv(
        ["chat", "--model", "builtin:tiny", "-n", "2", "--cache-budget", "1MB", "--plan", "--json"],
        home,
    )
    assert [r["budget"] for r in json.loads(fixed.stdout)["ranks"]] == [10**6, 10**6]
    # Tensor parallel has no split: the memory is checked and the budgets set.
    tensor = run_exokv(
        ["chat", "--model", "builtin:tiny", "-n", "2", "--parallel", "tensor", "--plan", "--json"],
        home,
    )
    doc = json.loads(tensor.stdout)
    assert doc["split"] is None and doc["parallel"] == "tensor"
    assert [r["layers"] for r in doc["ranks"]] == [None, None]
    # One rank: the whole model on this machine.
    single = run_exokv(["chat", "--model", "builtin:tiny", "--plan", "--json"], home)
    assert json.loads(single.stdout)["ranks"][0]["layers"] == [0, 4]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_model_too_big_for_the_hosts_is_refused_before_loading(tmp_path, models_dir):
    home = home_with_models(tmp_path / "h", models_dir, True)
    for args in (["-n", "2"], ["-n", "2", "--plan"]):
        proc = run_exokv(
            ["chat", "--model", "builtin:tiny", *args, "--starting-port", "31720"],
            home,
            "Hello\n",
            env={"EXOKV_TEST_HOST_MEMORY": "2MB,1MB"},
        )
        err = proc.stderr.decode()
        assert proc.returncode == 2, err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("exokv: error: the model does not fit:") and "short" in err
        assert "Traceback" not in err and proc.stdout == b""
    assert not (home / "exokv.db").exists()  # refused before the store, the ranks, the weights


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_split_and_memory_settings_are_one_line(tmp_path, models_dir):
    home = home_with_models(tmp_path / "h", models_dir, True)
    cases = [
        (["--split", "auto"], {}, 0),  # auto on one rank: nothing to split, fine
        (["-n", "2", "--split", "x"], {}, 2),
        (["-n", "2"], {"EXOKV_TEST_HOST_MEMORY": "1GB,2GB,3GB"}, 2),
        (["-n", "2"], {"EXOKV_TEST_HOST_MEMORY": "lots"}, 2),
    ]
    for args, env, code in cases:
        proc = run_exokv(["chat", "--model", "builtin:tiny", "--plan", *args], home, env=env)
        err = proc.stderr.decode()
        assert proc.returncode == code, (args, err)
        if code:
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_serve_plans_the_same_way(tmp_path, models_dir):
    home = home_with_models(tmp_path / "h", models_dir, True)
    proc = run_exokv(["serve", "--model", "builtin:tiny", "-n", "2", "--plan"], home, env=UNEVEN)
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()
    assert "split 3,1 (placed from memory)" in out and "cache budget" in out
    too_big = run_exokv(
        ["serve", "--model", "builtin:tiny", "-n", "2", "--port", "0"],
        home,
        env={"EXOKV_TEST_HOST_MEMORY": "1MB"},
    )
    assert too_big.returncode == 2 and b"does not fit" in too_big.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plan_over_ssh_hosts_gathers_each_hosts_memory(tmp_path, models_dir, ssh_hosts):
    home = home_with_models(tmp_path / "h", models_dir, True)
    env = ssh_hosts.env(EXOKV_HOME=str(home))

    def plan(hosts: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny"]
            + ["--hosts", hosts, "--plan", "--json"],
            capture_output=True,
            env=env,
            timeout=90,
        )
        assert proc.returncode == 0, proc.stderr.decode()
        return json.loads(proc.stdout)

    two = plan("exokv-a,exokv-b")
    assert [r["host"] for r in two["ranks"]] == ["exokv-a", "exokv-b"]
    assert all(r["memory"] > 10**8 for r in two["ranks"]) and two["split"] == [2, 2]
    # Two ranks on one host share its memory.
    shared = plan("exokv-a,exokv-a,exokv-b")
    a, _, b = (r["memory"] for r in shared["ranks"])
    assert 0.4 < a / b < 0.6


def test_sizes_that_cannot_be_read_fall_back_to_the_even_split(tmp_path, models_dir, capsys):
    """A local model short of a shard here: no plan, the split left to the ranks' even
    default; with every rank on this machine nothing is said (the ranks' own refusal
    names the file: tests/test_zoo_chat.py); --plan says why as an error."""
    from exokv.core.options import ClusterOptions
    from exokv.hosts.plan import place
    from exokv.model.layer_sizes import SizesUnknown

    partial = tmp_path / "partial"
    partial.mkdir()
    for f in (models_dir / "tiny").iterdir():
        if f.name != "model-00002-of-00005.safetensors":
            os.symlink(f, partial / f.name)
    cluster = ClusterOptions(model=str(partial), ranks=2, rank_count=2)
    placed, plan = place(cluster)
    assert plan is None and placed == cluster
    assert capsys.readouterr().err == ""
    with pytest.raises(SizesUnknown, match="not here"):
        place(cluster, show=True)
    one, plan = place(ClusterOptions(model=str(partial)))  # one rank: no plan at all
    assert plan is None
