"""Read-side queries: plain dicts with stable keys, the ``--json`` documents of `exokv cache`.

Every function takes a connection already inside one read transaction
(``Store.snapshot``), so the numbers in one document come from the same turns.
Times are ISO 8601 strings in UTC.
"""

from __future__ import annotations

import json
import socket
import sqlite3
from datetime import datetime, timezone
from typing import Any

from exokv.state.running import pid_alive


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def _ratio(part: float, whole: float | None, scale: float = 1.0, digits: int = 4) -> float | None:
    if not whole:
        return None
    return round(scale * part / whole, digits)


def run_is_running(row: sqlite3.Row) -> bool:
    """A run row's process still runs (a row from another host is trusted until it ends)."""
    if row["ended"] is not None:
        return False
    if row["host"] and row["host"] != socket.gethostname():
        return True  # another machine's process: trust that it has not ended
    return pid_alive(row["pid"], row["started"])


def _run_dict(row: sqlite3.Row, running: bool) -> dict[str, Any]:
    return {
        "id": row["id"],
        "pid": row["pid"],
        "host": row["host"],
        "model": row["model"],
        "ranks": row["ranks"],
        "budgets": json.loads(row["budgets"]),
        "started": iso(row["started"]),
        "ended": iso(row["ended"]),
        "running": running,
    }


def current_runs(db: sqlite3.Connection | None) -> list[dict[str, Any]]:
    """The runs whose cache is "the cache": those running now, else the latest one."""
    if db is None:
        return []
    rows = db.execute("SELECT * FROM runs ORDER BY id").fetchall()
    live = [_run_dict(r, True) for r in rows if run_is_running(r)]
    if live or not rows:
        return live
    return [_run_dict(rows[-1], False)]


def _live_entries(db: sqlite3.Connection, run_id: int) -> list[sqlite3.Row]:
    return db.execute(
        "SELECT * FROM cache_entries WHERE run_id = ? AND evicted_at IS NULL ORDER BY node_id",
        (run_id,),
    ).fetchall()


def _latest_samples(db: sqlite3.Connection, run_id: int) -> dict[int, sqlite3.Row]:
    rows = db.execute(
        "SELECT * FROM memory_samples WHERE id IN "
        "(SELECT MAX(id) FROM memory_samples WHERE run_id = ? GROUP BY rank)",
        (run_id,),
    ).fetchall()
    return {r["rank"]: r for r in rows}


def _sampled_disk(samples: dict[int, Any], rank: int) -> int:
    sample = samples.get(rank)
    return int(sample["disk_bytes"] or 0) if sample is not None else 0


def latest_samples(db: sqlite3.Connection, run_id: int) -> list[dict[str, Any]]:
    """Each rank's latest memory sample of a run, as RankStats fields."""
    keys = ("rank", "pressure", "cache_bytes", "entries", "budget", "rss", "mlx_active")
    keys += ("ram_total", "disk_bytes", "disk_budget", "replica_bytes")
    rows = _latest_samples(db, run_id)
    return [{k: rows[r][k] for k in keys} for r in sorted(rows)]


def _rank_numbers(
    run: dict[str, Any], samples: dict[int, Any], sizes: list[list[int]]
) -> list[int]:
    width = max((len(b) for b in sizes), default=0)
    return sorted(set(range(max(run["ranks"], width))) | set(samples))


def _run_turns(db: sqlite3.Connection, run_id: int) -> dict[str, int]:
    row = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(cached_tokens > 0), 0), COALESCE(SUM(cached_tokens), 0), "
        "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(prefilled_tokens), 0), "
        "COALESCE(SUM(draft_tokens), 0), COALESCE(SUM(accepted_tokens), 0), "
        "COALESCE(SUM(replica_bytes), 0), COALESCE(SUM(replica_s), 0), "
        "COALESCE(SUM(replica_bytes > 0), 0) "
        "FROM turns WHERE run_id = ?",
        (run_id,),
    ).fetchone()
    evictions = db.execute(
        "SELECT COUNT(*) FROM cache_events WHERE run_id = ? AND kind = 'evict'", (run_id,)
    ).fetchone()[0]
    # Typing ahead (exokv.rank.typeahead): steps and tokens prefilled before Enter, and
    # the tokens of those turns then used.
    typed = db.execute(
        "SELECT COUNT(CASE WHEN kind = 'draft' THEN 1 END), "
        "COALESCE(SUM(CASE WHEN kind = 'draft' THEN tokens END), 0), "
        "COALESCE(SUM(CASE WHEN kind = 'draft-used' THEN tokens END), 0) "
        "FROM cache_events WHERE run_id = ?",
        (run_id,),
    ).fetchone()
    return {
        "turns": row[0],
        "hits": row[1],
        "misses": row[0] - row[1],
        "tokens_saved": row[2],
        "prompt_tokens": row[3],
        "prefilled_tokens": row[4],
        "evictions": evictions,
        "typeahead_steps": typed[0],
        "typeahead_tokens": typed[1],
        "typeahead_used": typed[2],
        "draft_tokens": row[5],
        "accepted_tokens": row[6],
        "replica_bytes": row[7],
        "replica_s": row[8],
        "replica_turns": row[9],
    }


def _replica_seconds(db: sqlite3.Connection, run_id: int) -> list[float]:
    """The seconds of each turn's replica copies (--replicas), over the turns that copied."""
    rows = db.execute(
        "SELECT replica_s FROM turns WHERE run_id = ? AND replica_bytes > 0", (run_id,)
    ).fetchall()
    return [float(r[0]) for r in rows]


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _budget_for(run: dict[str, Any], sample: Any, rank: int) -> int | None:
    if sample is not None and sample["budget"] is not None:
        return int(sample["budget"])
    budgets = run["budgets"]
    return budgets[rank] if rank < len(budgets) else None


# What the total adds up over the runs and ranks (the rest of it is worked out from these).
_SUMMED_KEYS = (
    "entries",
    "cached_tokens",
    "bytes",
    "disk_bytes",
    "turns",
    "hits",
    "misses",
    "tokens_saved",
    "prompt_tokens",
    "prefilled_tokens",
    "evictions",
    "typeahead_steps",
    "typeahead_tokens",
    "typeahead_used",
    "draft_tokens",
    "accepted_tokens",
    "replica_bytes",
    "replica_s",
    "replica_turns",
)
_TOTAL_KEYS = (
    "entries",
    "cached_tokens",
    "bytes",
    "disk_bytes",
    "budget",
    "budget_pct",
    "hits",
    "misses",
    "hit_rate",
    "tokens_saved",
    "evictions",
    "turns",
    "prompt_tokens",
    "prefilled_tokens",
    "typeahead_steps",
    "typeahead_tokens",
    "typeahead_used",
    "draft_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "replica_bytes",
    "replica_s",
    "replica_turns",
    "replica_median_s",
)


def stats(db: sqlite3.Connection | None) -> dict[str, Any]:
    """Per (run, rank) and total: the document of `exokv cache stats --json`."""
    runs = current_runs(db) if db is not None else []
    ranks: list[dict[str, Any]] = []
    total: dict[str, Any] = dict.fromkeys(_SUMMED_KEYS, 0)
    budgets: list[int | None] = []
    copies: list[float] = []
    for run in runs:
        ranks += _run_ranks(db, run, total, budgets)
        copies += _replica_seconds(db, run["id"])
    budget_total = None if not budgets or None in budgets else sum(b or 0 for b in budgets)
    total["budget"] = budget_total
    total["budget_pct"] = _ratio(total["bytes"], budget_total, 100.0, 1)
    total["hit_rate"] = _ratio(total["hits"], total["turns"])
    total["acceptance_rate"] = _ratio(total["accepted_tokens"], total["draft_tokens"])
    total["replica_s"] = round(total["replica_s"], 3)
    median = _median(copies)
    total["replica_median_s"] = round(median, 3) if median is not None else None
    total = {key: total[key] for key in _TOTAL_KEYS}
    sessions = db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] if db is not None else 0
    return {"runs": runs, "sessions": sessions, "ranks": ranks, "total": total}


def _run_ranks(
    db: sqlite3.Connection, run: dict[str, Any], total: dict[str, Any], budgets: list[int | None]
) -> list[dict[str, Any]]:
    """One run's rows of `stats`, a rank each; its sums added to `total` and each rank's
    budget to `budgets`."""
    live = _live_entries(db, run["id"])
    sizes = [json.loads(e["bytes"]) for e in live]
    samples = _latest_samples(db, run["id"])
    counts = _run_turns(db, run["id"])
    for key, value in counts.items():
        total[key] += value
    total["entries"] += len(live)
    total["cached_tokens"] += sum(e["tokens"] for e in live)
    rows = []
    for rank in _rank_numbers(run, samples, sizes):
        held = [(e, b) for e, b in zip(live, sizes, strict=True) if rank < len(b)]
        size = sum(b[rank] for e, b in held if e["tier"] == "ram")
        # The rank's own count of its disk tier: the entries that left RAM and the
        # copies that stayed (write-through, /save), as docs/cache.md says.
        disk = max(
            sum(b[rank] for e, b in held if e["tier"] != "ram"), _sampled_disk(samples, rank)
        )
        budget = _budget_for(run, samples.get(rank), rank)
        budgets.append(budget)
        total["bytes"] += size
        total["disk_bytes"] += disk
        rows.append(
            {
                "run": run["id"],
                "rank": rank,
                "entries": len(held),
                "cached_tokens": sum(e["tokens"] for e, _ in held),
                "bytes": size,
                "disk_bytes": disk,
                "budget": budget,
                "budget_pct": _ratio(size, budget, 100.0, 1),
                "pressure": samples[rank]["pressure"] if rank in samples else None,
                "hits": counts["hits"],
                "misses": counts["misses"],
                "hit_rate": _ratio(counts["hits"], counts["turns"]),
                "tokens_saved": counts["tokens_saved"],
                "evictions": counts["evictions"],
                "typeahead_steps": counts["typeahead_steps"],
                "typeahead_tokens": counts["typeahead_tokens"],
                "typeahead_used": counts["typeahead_used"],
                "draft_tokens": counts["draft_tokens"],
                "accepted_tokens": counts["accepted_tokens"],
                "acceptance_rate": _ratio(counts["accepted_tokens"], counts["draft_tokens"]),
            }
        )
    return rows


def entries(db: sqlite3.Connection | None, session: str | None = None) -> list[dict[str, Any]]:
    """Live entries of the current runs: the rows of `exokv cache entries --json`."""
    if db is None:
        return []
    pins = pinned_sessions(db)
    out = []
    for run in current_runs(db):
        live = _live_entries(db, run["id"])
        times = _entry_times(db, run["id"], live)
        for e in live:
            if session is not None and e["session"] != session:
                continue
            sizes = json.loads(e["bytes"])
            created, last_used = times[e["node_id"]]
            out.append(
                {
                    "run": run["id"],
                    "id": e["node_id"],
                    "parent": e["parent"],
                    "session": e["session"],
                    "model": e["model"],
                    "tokens": e["tokens"],
                    "depth": e["depth"],
                    "bytes": sizes,
                    "total_bytes": sum(sizes),
                    "tier": e["tier"],
                    "pinned": e["session"] in pins,
                    "hits": e["hits"],
                    "created": iso(created),
                    "last_used": iso(last_used),
                }
            )
    return out


def _entry_times(
    db: sqlite3.Connection, run_id: int, live: list[sqlite3.Row]
) -> dict[int, tuple[float, float]]:
    """Each live entry's own (created, last used) wall times, by node id.

    A run's `cache_entries` row starts when the run first records the entry, so an entry
    a chat restored from the persisted tree (the disk tier keeps node ids, depths and
    the tree's clock across chats) would look created and used at that chat's first
    turn. Its history is in the earlier runs instead: the same model's rows of the same
    node id and depth (a node's end position, kept through splits) are the same entry.
    - created: its `add` event, in the run whose tree made the node; a run that records
      no `add` for it took it over from the run before.
    - last used: the row's time in the latest run where the tree's clock for it (`tick`,
      which only a use moves) moved; a row whose tick is the one it was restored with
      was not used in that run.
    """
    if not live:
        return {}
    model = live[0]["model"]
    earlier: dict[tuple[int, int], list[sqlite3.Row]] = {}
    for r in db.execute(
        "SELECT run_id, node_id, depth, tick, created, last_used FROM cache_entries "
        "WHERE model = ? AND run_id < ? ORDER BY run_id DESC",
        (model, run_id),
    ):
        earlier.setdefault((r["node_id"], r["depth"]), []).append(r)
    added: dict[tuple[int, int], float] = {
        (r[0], r[1]): r[2]
        for r in db.execute(
            "SELECT run_id, entry, MIN(time) FROM cache_events "
            "WHERE kind = 'add' AND run_id <= ? GROUP BY run_id, entry",
            (run_id,),
        )
    }
    out = {}
    for e in live:
        chain = [e, *earlier.get((e["node_id"], e["depth"]), [])]
        # Back through the runs that took the entry over, to the one that made it.
        start = 0
        while (chain[start]["run_id"], e["node_id"]) not in added and start + 1 < len(chain):
            start += 1
        chain = chain[: start + 1]
        made = chain[-1]
        created = added.get((made["run_id"], e["node_id"]), made["created"])
        used = next(
            (r for r, before in zip(chain, chain[1:], strict=False) if r["tick"] != before["tick"]),
            made,
        )
        out[e["node_id"]] = (created, max(used["last_used"], created))
    return out


def pinned_sessions(db: sqlite3.Connection) -> set[str]:
    """The sessions pinned with /pin (none in a database older than pins)."""
    try:
        return {r[0] for r in db.execute("SELECT name FROM sessions WHERE pinned")}
    except sqlite3.OperationalError:
        return set()


def pressure(
    db: sqlite3.Connection | None, rank: int | None = None, history: int = 30
) -> list[dict[str, Any]]:
    """Latest sample and recent history per (run, rank), oldest sample first."""
    if db is None:
        return []
    out = []
    for run in current_runs(db):
        samples = _latest_samples(db, run["id"])
        for r in _rank_numbers(run, samples, []):
            if rank is not None and r != rank:
                continue
            rows = db.execute(
                "SELECT * FROM memory_samples WHERE run_id = ? AND rank = ? "
                "ORDER BY id DESC LIMIT ?",
                (run["id"], r, history),
            ).fetchall()[::-1]
            last = rows[-1] if rows else None
            out.append(
                {
                    "run": run["id"],
                    "rank": r,
                    "time": iso(last["time"]) if last else None,
                    "pressure": last["pressure"] if last else None,
                    "cache_bytes": last["cache_bytes"] if last else None,
                    "entries": last["entries"] if last else None,
                    "budget": _budget_for(run, last, r),
                    "rss": last["rss"] if last else None,
                    "mlx_active": last["mlx_active"] if last else None,
                    "ram_total": last["ram_total"] if last else None,
                    "disk_bytes": last["disk_bytes"] if last else None,
                    "replica_bytes": last["replica_bytes"] if last else None,
                    "history": [
                        {
                            "time": iso(s["time"]),
                            "pressure": s["pressure"],
                            "cache_bytes": s["cache_bytes"],
                        }
                        for s in rows
                    ],
                }
            )
    return out


def evictions(
    db: sqlite3.Connection | None,
    rank: int | None = None,
    limit: int = 20,
    since: float | None = None,
) -> list[dict[str, Any]]:
    """The eviction log of every run, newest first.

    ``freed`` is the bytes freed on ``rank`` when one is given, else on all ranks.
    ``session`` is the evicted entry's; ``turn_session``/``turn`` name the turn that
    decided it (None for decisions outside a turn).
    """
    if db is None:
        return []
    where = ["e.kind = 'evict'"]
    params: list[Any] = []
    if since is not None:
        where.append("e.time >= ?")
        params.append(since)
    if rank is not None:
        where.append("json_array_length(e.bytes) > ?")
        params.append(rank)
    rows = db.execute(
        "SELECT e.*, t.turn AS turn, s.name AS turn_session FROM cache_events e "
        "LEFT JOIN turns t ON t.id = e.turn_id LEFT JOIN sessions s ON s.id = t.session_id "
        f"WHERE {' AND '.join(where)} ORDER BY e.time DESC, e.id DESC LIMIT ?",
        (*params, limit),
    ).fetchall()
    out = []
    for e in rows:
        sizes = json.loads(e["bytes"])
        out.append(
            {
                "id": e["id"],
                "run": e["run_id"],
                "turn": e["turn"],
                "turn_session": e["turn_session"],
                "time": iso(e["time"]),
                "decision": e["decision"],
                "entry": e["entry"],
                "session": e["session"],
                "tokens": e["tokens"],
                "bytes": sizes,
                "freed": sizes[rank] if rank is not None else sum(sizes),
                "reason": e["reason"],
                "pressures": json.loads(e["pressures"]),
            }
        )
    return out


def sessions(db: sqlite3.Connection, name: str | None = None) -> list[dict[str, Any]]:
    """Every session (or the one named), most recently used first.

    ``tokens`` is its context at the last turn.
    """
    where = "" if name is None else "WHERE s.name = ? "
    rows = db.execute(
        "SELECT s.*, "
        "(SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id) AS messages, "
        "(SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) AS turns, "
        "(SELECT COALESCE(SUM(cached_tokens), 0) FROM turns t WHERE t.session_id = s.id) "
        " AS cached, "
        "(SELECT prompt_tokens + generated_tokens FROM turns t WHERE t.session_id = s.id "
        " ORDER BY t.id DESC LIMIT 1) AS tokens "
        f"FROM sessions s {where}ORDER BY s.last_used DESC, s.id DESC",
        () if name is None else (name,),
    ).fetchall()
    return [
        {
            "name": r["name"],
            "model": r["model"],
            "system": r["system"],
            "max_kv_size": r["max_kv_size"] if "max_kv_size" in r.keys() else None,
            "chat_template": r["chat_template"] if "chat_template" in r.keys() else None,
            "pinned": bool(r["pinned"]) if "pinned" in r.keys() else False,
            "messages": r["messages"],
            "turns": r["turns"],
            "tokens": r["tokens"] or 0,
            "cached_tokens": r["cached"],
            "created": iso(r["created"]),
            "last_used": iso(r["last_used"]),
        }
        for r in rows
    ]
