"""One host's fetch before the ranks start, run there by exokv.launch.remote: JSON lines out.

``main()`` takes the model and what the host's ranks load, fetches it into the
host's own Hugging Face cache (exokv.model.hub) and prints one JSON object a line:
``plan`` (the files it will fetch, their bytes), ``bytes`` (done/total, a few
times a second), ``file`` (one finished), then ``done`` (the snapshot, what was
fetched) or ``error`` (one line) with exit code 1. The front end
(exokv.hosts.fetch) shows them per host. ``--dry-run`` fetches no weights, and
``done`` lists the ones that would be fetched (what `hosts check` can report).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from exokv.errors import ExokvError, one_line
from exokv.model import hub


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exokv.model.fetcher")
    parser.add_argument("--model", required=True, help="org/name or org/name@revision")
    parser.add_argument("--commit", default=None, help="the commit the revision names")
    parser.add_argument("--ranks", type=int, default=1, help="ranks in the run")
    parser.add_argument("--host-ranks", default="0", help="this host's ranks (0,2); '' : none")
    parser.add_argument("--split", default=None, help="layers per rank, rank 0 first")
    parser.add_argument("--parallel", default="pipeline")
    parser.add_argument(
        "--dry-run", action="store_true", help="fetch no weights: say which would be fetched"
    )
    return parser.parse_args(argv)


def _say(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    name = hub.parse_name(args.model)
    if name is None:
        _say({"event": "error", "message": f"not a Hugging Face repo id: {args.model!r}"})
        return 1
    want = hub.Want(
        ranks=args.ranks,
        host_ranks=[int(r) for r in args.host_ranks.split(",")] if args.host_ranks else None,
        split=[int(n) for n in args.split.split(",")] if args.split else None,
        parallel=args.parallel,
    )
    try:
        got = hub.fetch(
            *name, want, commit=args.commit, progress=_say, bars=False, dry_run=args.dry_run
        )
    except ExokvError as err:
        _say({"event": "error", "message": str(err)})
        return 1
    except Exception as err:  # noqa: BLE001 - a host's failure is one line at the front end
        _say({"event": "error", "message": one_line(err)[:400]})
        return 1
    _say(
        {
            "event": "done",
            "path": str(got.path),
            "commit": got.commit,
            "fetched": got.fetched,
            "bytes": got.bytes,
            "files": got.files,
        }
    )
    return 0
