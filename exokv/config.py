"""exokv's settings: every EXOKV_* environment variable, declared once and read here alone.

`SETTINGS` is the registry: each variable's name, the kind of value it takes, its
default and one line of help; the accessors below are the only readers of the
environment. The user-facing ones are listed in docs/settings.md (a test keeps it
complete). The test hooks, each named EXOKV_TEST_*, let the test suite play failures
and slow or short-of-memory machines; they change what exokv does, so a user never
sets them. A setting marked `forwarded` reaches ranks on other machines
(`mlx.launch --env`): local ranks inherit the whole environment anyway.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from exokv.core.sizes import parse_size
from exokv.errors import UsageError

DEFAULT_MODEL = "smollm2"
DEFAULT_MEMORY_THRESHOLD = 0.9


@dataclass(frozen=True)
class Setting:
    """One EXOKV_* environment variable."""

    name: str
    kind: str  # the value it takes, as the docs show it
    default: str  # what applies when it is unset, as the docs show it
    help: str
    forwarded: bool = False  # ranks on other hosts get it too (never a secret)
    test: bool = False  # a test hook (EXOKV_TEST_*): not for users

    def text(self) -> str | None:
        """The value as set; None when unset or empty."""
        return os.environ.get(self.name) or None

    def on(self) -> bool:
        """A switch: on unless unset, empty or 0."""
        return os.environ.get(self.name, "") not in ("", "0")


HOME = Setting(
    "EXOKV_HOME",
    "path",
    "~/Library/Application Support/exokv (macOS), $XDG_STATE_HOME/exokv or ~/.local/state/exokv",
    "where exokv keeps its state: the database, the disk tier, history and models",
)
MODELS = Setting(
    "EXOKV_MODELS",
    "path",
    "~/Library/Caches/exokv/models (macOS), $XDG_CACHE_HOME/exokv/models or ~/.cache/exokv/models",
    "converted real models, shared by every EXOKV_HOME on this machine",
)
MODEL = Setting(
    "EXOKV_MODEL",
    "model name",
    DEFAULT_MODEL,
    "the model when --model is not given (as --model takes it)",
)
DEBUG = Setting(
    "EXOKV_DEBUG",
    "1 or 0",
    "0",
    "tracebacks with errors, and the ranks' own output on stderr",
    forwarded=True,
)
RANK_LOG = Setting(
    "EXOKV_RANK_LOG",
    "1 or 0",
    "0",
    "each rank logs every turn (its cache decision, events, collectives) to "
    "EXOKV_HOME/ranks/rank-N.jsonl",
    forwarded=True,
)
API_KEY = Setting(
    "EXOKV_API_KEY",
    "text",
    "none",
    "exokv serve: the key requests must bring (as --api-key)",
)

# -- test hooks ---------------------------------------------------------------------

TEST_FAIL_AT = Setting(
    "EXOKV_TEST_FAIL_AT",
    "RANK:PHASE (prefill, decode or insert)",
    "none",
    "that rank raises when a turn reaches that phase, as a real failure there would",
    forwarded=True,
    test=True,
)
TEST_SLOW_TEXTS = Setting(
    "EXOKV_TEST_SLOW_TEXTS",
    "seconds",
    "0",
    "the front end takes this long over each message of text (a front end that lags)",
    test=True,
)
TEST_SLOW_PREFILL = Setting(
    "EXOKV_TEST_SLOW_PREFILL",
    "seconds per token",
    "0",
    "every prefill step (a turn's or a typeahead step's) takes this much longer per token, "
    "as on a slow model",
    forwarded=True,
    test=True,
)
TEST_FAKE_PRESSURE = Setting(
    "EXOKV_TEST_FAKE_PRESSURE",
    "fractions, one per rank (0.5 or 0.5,0.97)",
    "the real pressure",
    "pins each rank's memory pressure, so eviction acts as on a machine short of memory",
    forwarded=True,
    test=True,
)
TEST_FAKE_VERSIONS = Setting(
    "EXOKV_TEST_FAKE_VERSIONS",
    "path of a JSON file of versions (~ is each host's own HOME)",
    "none",
    "a host whose file exists reports those versions (exokv.hosts.probe), as a host with "
    "other installs would",
    forwarded=True,
    test=True,
)

TEST_HOLD_BEAT = Setting(
    "EXOKV_TEST_HOLD_BEAT",
    "RANK:SECONDS",
    "none",
    "that rank's heartbeat thread stops for that long once its shard is loaded, while "
    "the rank works on (a beat starved by a long kernel or a loaded machine)",
    forwarded=True,
    test=True,
)
TEST_WEDGED_S = Setting(
    "EXOKV_TEST_WEDGED_S",
    "seconds",
    "600",
    "how long a running rank may stay silent before the front end reports it wedged",
    test=True,
)
TEST_HOST_MEMORY = Setting(
    "EXOKV_TEST_HOST_MEMORY",
    "sizes, one per rank (24GB,8GB), one for all, or per host (mac-a=24GB,mac-b=8GB)",
    "each host's own",
    "the memory placement sees for each rank, each a host of its own: uneven Macs on one machine",
    test=True,
)
TEST_SHOWN_REPLY = Setting(
    "EXOKV_TEST_SHOWN_REPLY",
    "path",
    "none",
    "the REPL shows this file's text in place of each reply, as much of it per streamed "
    "piece as the piece's length (nothing once it is all shown); what is stored is unchanged",
    test=True,
)
TEST_DRAFTS = Setting(
    "EXOKV_TEST_DRAFTS",
    "path of a JSON list of token ids",
    "none",
    "rank 0 drafts each reply from this list (what follows the reply's length in it, every "
    "third token made wrong) instead of the conversation: the verify path on models that "
    "never repeat",
    test=True,
)

SETTINGS: tuple[Setting, ...] = (
    HOME,
    MODELS,
    MODEL,
    DEBUG,
    RANK_LOG,
    API_KEY,
    TEST_FAIL_AT,
    TEST_SLOW_TEXTS,
    TEST_SLOW_PREFILL,
    TEST_FAKE_PRESSURE,
    TEST_FAKE_VERSIONS,
    TEST_HOLD_BEAT,
    TEST_WEDGED_S,
    TEST_HOST_MEMORY,
    TEST_SHOWN_REPLY,
    TEST_DRAFTS,
)
# What a rank on another machine should see as this one does.
FORWARDED_ENV: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.forwarded)


def exokv_home() -> Path:
    """The state directory: EXOKV_HOME, else the platform's per-user state dir."""
    env = HOME.text()
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "exokv"
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "exokv"


def machine_models_dir() -> Path:
    """Converted real models, shared by every EXOKV_HOME on this machine.

    EXOKV_MODELS, else the platform's per-user cache dir: a conversion is
    redone from its source if lost, and tests and sessions share one copy.
    """
    env = MODELS.text()
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "exokv" / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "exokv" / "models"


def default_model(fallback: str = DEFAULT_MODEL) -> str:
    """EXOKV_MODEL, else `fallback` (`exokv bench` has a default of its own)."""
    return MODEL.text() or fallback


def debug_enabled() -> bool:
    return DEBUG.on()


def rank_log_enabled() -> bool:
    return RANK_LOG.on()


# A running rank silent this long is wedged, not busy: longer than any step exokv runs
# (a prefill step, a decode step and a cache save take seconds; a shard loads before
# the ranks are judged this way), short enough that a chat does not hang for good.
WEDGED_S = 600.0


class TestHooks:
    """The test hooks (EXOKV_TEST_*): how the suite plays failures and slow, lagging or
    short-of-memory machines. Production code reaches them only through `TEST_HOOKS`, so
    one name finds every place a test can change what exokv does. Each reads the
    environment when asked: a test sets a hook for the processes it starts."""

    __test__ = False  # a name pytest would otherwise collect where a test imports it

    def fail_at(self) -> str:
        """EXOKV_TEST_FAIL_AT as set ("" when unset); exokv.rank.main reads its RANK:phase."""
        return os.environ.get(TEST_FAIL_AT.name, "")

    def slow_texts(self) -> float:
        """EXOKV_TEST_SLOW_TEXTS in seconds (0: no lag)."""
        return float(TEST_SLOW_TEXTS.text() or 0)

    def drafts(self) -> list[int] | None:
        """The token ids EXOKV_TEST_DRAFTS's file lists (None when unset)."""
        path = TEST_DRAFTS.text()
        if path is None:
            return None
        with open(path, encoding="utf-8") as f:
            return [int(t) for t in json.load(f)]

    def shown_reply(self) -> str | None:
        """The text EXOKV_TEST_SHOWN_REPLY's file holds (None when unset)."""
        path = TEST_SHOWN_REPLY.text()
        if path is None:
            return None
        with open(path, encoding="utf-8") as f:
            return f.read()

    def slow_prefill(self) -> float:
        """EXOKV_TEST_SLOW_PREFILL in seconds per token (0: the model's own speed)."""
        return float(TEST_SLOW_PREFILL.text() or 0)

    def fake_pressure(self, rank: int) -> float | None:
        """The pressure EXOKV_TEST_FAKE_PRESSURE pins for `rank` (the last value for ranks
        beyond the list); None when unset."""
        text = TEST_FAKE_PRESSURE.text()
        if not text:
            return None
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            raise UsageError(
                f"{TEST_FAKE_PRESSURE.name}={text!r} is not a list of fractions"
            ) from None
        return values[rank] if rank < len(values) else values[-1]

    def fake_versions(self) -> str | None:
        """EXOKV_TEST_FAKE_VERSIONS as set (a path, not yet expanded); None when unset."""
        return TEST_FAKE_VERSIONS.text()

    def wedged_s(self) -> float:
        """The seconds a running rank may stay silent: WEDGED_S, or EXOKV_TEST_WEDGED_S's."""
        text = TEST_WEDGED_S.text()
        try:
            return float(text) if text else WEDGED_S
        except ValueError:
            raise UsageError(f"{TEST_WEDGED_S.name}={text!r} is not a number of seconds") from None

    def hold_beat(self, rank: int) -> float:
        """The seconds EXOKV_TEST_HOLD_BEAT holds `rank`'s heartbeat (0: not this rank)."""
        text = TEST_HOLD_BEAT.text()
        if not text:
            return 0.0
        try:
            who, seconds = text.split(":")
            return float(seconds) if int(who) == rank else 0.0
        except ValueError:
            raise UsageError(f"{TEST_HOLD_BEAT.name}={text!r} is not RANK:SECONDS") from None

    def host_memory(self, hosts: list[str]) -> list[int] | None:
        """EXOKV_TEST_HOST_MEMORY: the memory of each rank (on `hosts`, in rank order) as
        placement should see it: one size for all, one per rank, or NAME=SIZE per host
        (a re-plan on fewer hosts keeps each host's); None: unset."""
        text = TEST_HOST_MEMORY.text()
        if not text:
            return None
        try:
            if "=" in text:
                named = dict(item.split("=", 1) for item in text.split(","))
                return [parse_size(named[host]) for host in hosts]
            values = [parse_size(v) for v in text.split(",")]
        except (UsageError, ValueError, KeyError):
            raise UsageError(
                f"{TEST_HOST_MEMORY.name}={text!r} is not a list of sizes (or of HOST=SIZE)"
            ) from None
        ranks = len(hosts)
        if len(values) not in (1, ranks):
            raise UsageError(f"{TEST_HOST_MEMORY.name} has {len(values)} sizes for {ranks} ranks")
        return values * ranks if len(values) == 1 else values


TEST_HOOKS = TestHooks()
