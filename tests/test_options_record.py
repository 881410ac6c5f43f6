"""One typed configuration (issue 42): the flags chat and serve share, the one word the
ranks start with, and the one place a rank's engine options are read from it."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from exokv.cli import flags
from exokv.cli.app import chat, serve
from exokv.core.options import AUTO, ClusterOptions, KvQuant, RankOptions
from exokv.frontend.start import ChatOptions
from exokv.hosts.hostfile import parse_hosts


def _passed_names(command) -> set[str]:
    return set(flags.passed_on(command, dict.fromkeys(inspect.signature(command).parameters)))


def test_chat_and_serve_pass_on_the_same_flags_as_chat_options_fields() -> None:
    names = _passed_names(chat)
    assert names == _passed_names(serve)
    assert len(names) == len(flags.PASSED_ON)  # each flag in both signatures, once
    assert names <= {f.name for f in dataclasses.fields(ChatOptions)}


def test_the_ranks_word_carries_every_option_and_no_hosts() -> None:
    cluster = ClusterOptions(
        model="builtin:tiny",
        ranks=1,
        rank_count=2,
        hosts=parse_hosts("10.0.0.1,10.0.0.2"),
        backend="jaccl",
        parallel="pipeline",
        split=[3, 1],
        budgets=[64 << 20, 16 << 20],
        memory_threshold=0.5,
        max_kv_size=512,
        seed=7,
        disk_budget=AUTO,
        kv=KvQuant(8, 32),
        chat_template="{% for m in messages %}'{{ m.content }}' \"$HOME\"\n{% endfor %}",
        stops=("</s>", "\nUser:"),
        context=2048,
        draft_model="builtin:tiny",
    )
    opts = RankOptions(cluster, ranks_here=2, front_end_pid=1234, wake_host="10.0.0.1")
    word = opts.to_arg()
    # One word whatever the template holds: nothing for a shell (ssh, mpirun) to split.
    assert re.fullmatch(r"[A-Za-z0-9_=-]+", word)
    assert RankOptions.from_arg(word) == dataclasses.replace(
        opts, cluster=dataclasses.replace(cluster, hosts=None)
    )


def test_a_ranks_engine_options_are_read_in_one_place(tmp_path: Path, monkeypatch) -> None:
    from exokv.rank.options import engine_options

    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    cluster = ClusterOptions(
        model="builtin:tiny",
        budgets=[5_000_000, 7_000_000],
        memory_threshold=0.8,
        seed=3,
        disk_budget=None,
        kv=KvQuant(4, 32),
        stops=("END",),
    )
    options = engine_options(RankOptions(cluster, ranks_here=2), rank=1, layout="pipeline:2:even")
    assert (options.budget, options.ranks_here, options.seed) == (7_000_000, 2, 3)
    assert (options.kv, options.stops) == (KvQuant(4, 32), ("END",))
    assert options.memory_threshold == 0.8 and options.disk_dir is None
    tiered = dataclasses.replace(cluster, disk_budget=1 << 20)
    options = engine_options(RankOptions(tiered), rank=0, layout="pipeline:2:even")
    assert options.disk_budget == 1 << 20
    assert options.disk_dir is not None and "kv4g32" in options.disk_dir
