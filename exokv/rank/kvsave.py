"""/save and resuming a session: the disk tier's own mechanism, seen from one rank.

There is one way exokv keeps KV on disk: the disk tier (`exokv.cache.disk_tier`). `/save`
(and quitting) writes the conversation's path in the prefix cache to every rank's
tier — the nodes stay in RAM, the chat goes on as before — and persists the tree, so
a new chat on the same model and rank layout, even after this one was killed, starts
with that conversation warm on disk. Resuming a session is then nothing but its next
turn: the fetch finds its tokens in the restored tree and loads them from disk, each
file checked (a bad one is a miss, prefilled again). With `--disk-budget 0` there is
no tier and nothing is saved; the report says so.

The functions here run on every rank alike; the front end sees `CacheFileReport`s,
plain JSON-able data.
"""

from __future__ import annotations

import time
from typing import Any

from exokv.core.records import TIER_OFF_BECAUSE, CacheFileReport

TIER_OFF = "the disk tier is off (--disk-budget 0)"


def tier_off(engine: Any) -> str:
    """Why there is no disk tier: --disk-budget 0, or the reason the rank gave when it
    could not open it (another chat holds it, an unusable folder)."""
    why = getattr(engine, "tier_notice", None)
    return f"{TIER_OFF_BECAUSE}{why}" if why else TIER_OFF


def _report(engine: Any, session: str) -> tuple[CacheFileReport, Any]:
    """The session's report and this rank's disk tier; with no tier (None) the report
    already says why it was skipped."""
    report = CacheFileReport(session=session)
    tier = engine.coord.tier
    if tier is None:
        report.skipped = tier_off(engine)
    return report, tier


def save_session(engine: Any, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
    """Write this rank's shard of the conversation's cached path to its disk tier."""
    start = time.perf_counter()
    report, tier = _report(engine, session)
    if tier is None:
        return report
    tokens = engine.render(messages)
    match = engine.cache.tree.match(tokens)
    path = match.path
    if not path:
        report.skipped = "nothing of this conversation is in the cache"
        return report
    reached, why = tier.save(path)
    saved = [n for n in path if n.depth <= reached]
    # The conversation's tokens it holds, as resuming counts them (`on_disk`): its last
    # node may run on past them (an undone turn, a reply's end the next prompt spells
    # otherwise), and those are no part of this conversation.
    report.tokens = min(reached, match.length)
    report.bytes = [sum(col) for col in zip(*(tier.node_bytes(n) for n in saved), strict=True)]
    report.paths = [str(tier.store.root)]
    report.disk_bytes = tier.disk_bytes()  # copies included: what /stats shows next
    report.events = [e.to_dict() for e in tier.take_events(engine.decision)]
    if why:
        report.warning = why if not reached else f"{why} after {reached:,} tokens"
    report.seconds = time.perf_counter() - start
    return report


def on_disk(engine: Any, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
    """How much of a resumed conversation the cache holds (restored from disk at start)."""
    report, tier = _report(engine, session)
    if tier is None:
        return report
    tokens = engine.render(messages)
    match = engine.cache.tree.match(tokens)
    report.tokens = min(match.length, len(tokens))
    report.on_disk = all(n.payload.tier == "disk" for n in match.path)
    report.paths = [str(tier.store.root)]
    return report
