"""exokv.launch.remote: a module run here and over ssh, its output, its time limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from exokv.launch.remote import run_module, run_on_each


def _module(tmp_path: Path, body: str) -> str:
    (tmp_path / "probe_mod.py").write_text(body)
    return "probe_mod"


def test_a_module_runs_here_with_its_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    name = _module(
        tmp_path, "import sys\ndef main():\n    print('got', *sys.argv[1:])\n    return 3\n"
    )
    seen: list[str] = []
    run = run_module(None, name, ["a", "b"], timeout=30, on_line=seen.append)
    assert run.returncode == 3 and not run.ok
    assert run.stdout == "got a b\n" and seen == ["got a b"]


def test_a_run_past_its_time_limit_is_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    name = _module(
        tmp_path, "import time\ndef main():\n    print('up', flush=True)\n    time.sleep(60)\n"
    )
    run = run_module(None, name, timeout=3)
    assert run.returncode is None and run.error == "no answer within 3 s"
    assert run.stdout == "up\n"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_each_host_answers_in_order_over_ssh(ssh_hosts, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", ssh_hosts.env()["PATH"])
    # The standard library's timeit has a main() that reads sys.argv: "-n 2" says "2 loops".
    runs = run_on_each(
        ["exokv-a", "exokv-b", "exokv-nowhere"],
        "timeit",
        lambda i: ["-n", str(i + 1), "-r", "1", "pass"],
        timeout=30,
    )
    assert runs[0].stdout.startswith("1 loop,") and runs[0].ok, runs[0]
    assert runs[1].stdout.startswith("2 loops,") and runs[1].ok, runs[1]
    assert not runs[2].ok and runs[2].error  # no such host: ssh's own line says so


def test_this_machine_probes_itself() -> None:
    from exokv.hosts.probe import HostFacts, probe

    facts = probe()
    assert 0 < facts.memory_available <= facts.memory_total
    assert facts.versions["mlx"] and facts.disk_free > 0
    assert HostFacts.from_json(facts.to_json()) == facts


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_each_host_gives_its_facts(ssh_hosts, monkeypatch: pytest.MonkeyPatch) -> None:
    from exokv.hosts.facts import gather_facts
    from exokv.hosts.probe import HostFacts

    monkeypatch.setenv("PATH", ssh_hosts.env()["PATH"])
    here, a, nowhere = gather_facts([None, "exokv-a", "exokv-nowhere"])
    assert isinstance(here, HostFacts) and isinstance(a, HostFacts)
    assert a.versions == here.versions and a.memory_total == here.memory_total
    assert isinstance(nowhere, str) and nowhere
