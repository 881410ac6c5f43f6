"""Models from the Hugging Face hub: the files one host needs, fetched into the HF cache.

A repo id (``org/name``, or ``org/name@REVISION``) is fetched with huggingface_hub
into its own cache (``HF_HOME``/``HF_HUB_CACHE``), so ``hf``, mlx-lm and exokv
share one copy; huggingface_hub reads ``HF_ENDPOINT``, ``HF_TOKEN`` and
``HF_HUB_OFFLINE`` itself. A host fetches only what it will load: config and
tokenizer files always, and of the weights the shards that ``model.safetensors.index.json``
says hold its layers, plus the shards of the tensors outside the layers (embedding,
final norm, head), which every exokv rank loads (each computes the logits).

A revision's files are cached first: when every file a host needs is in the
snapshot, nothing is asked of the hub (a chat starts offline, and a host that has
its files downloads nothing). Each file lands in the snapshot only once it is
whole (huggingface_hub downloads into ``blobs/*.incomplete`` and resumes from
there), so a file present is a file complete. The repo's file list, read from the
hub once per commit, is kept beside the snapshot (``exokv-files/<commit>.json``):
with it a snapshot is known complete for a host without asking the hub.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exokv.errors import ExokvError, one_line
from exokv.hosts.placement import even_split, local_range  # no mlx: a host's fetch stays light

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
INDEX = "model.safetensors.index.json"
DEFAULT_REVISION = "main"
# What a usable snapshot holds besides its weights; with "model*.safetensors" these
# are the globs mlx-lm fetches for a model.
META_PATTERNS = (
    "*.json",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
WEIGHT_PATTERN = "model*.safetensors"
# The same test as exokv.model.loading's: a tensor of decoder layer N.
# A decoder layer's tensors, in the spellings of mlx-lm's checkpoints:
# model.layers.N. (most families), language_model.model.layers.N. (vision-language
# wrappers), backbone.layers.N. (mamba), transformer.h.N. / model.h.N. (gpt2-like),
# transformer.blocks.N. (dbrx).
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_LISTING_DIR = "exokv-files"

Progress = Callable[[dict[str, Any]], None]


def parse_name(value: str) -> tuple[str, str | None] | None:
    """'org/name@rev' -> ('org/name', 'rev'), 'org/name' -> ('org/name', None); None: no repo id."""
    repo, at, revision = value.strip().partition("@")
    if not REPO_ID.match(repo) or (at and not revision):
        return None
    return repo, (revision or None)


def repo_of(model: str) -> tuple[str, str | None] | None:
    """`parse_name` of a --model value that is no local path: ('org/name', revision)."""
    if Path(model.strip()).expanduser().exists():
        return None
    return parse_name(model)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def storage_dir(repo: str) -> Path:
    return hf_cache_dir() / f"models--{repo.replace('/', '--')}"


def endpoint() -> str:
    # deferred: huggingface_hub reads HF_* from the environment when first imported
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


# -- which files (pure) ------------------------------------------------------------------


def layer_of(tensor: str) -> int | None:
    """The decoder layer a tensor belongs to; None for the embedding, norm, head."""
    m = _LAYER.search(tensor)
    return int(m.group(1)) if m else None


def meta_files(files: Iterable[str]) -> list[str]:
    """Config, tokenizer and index files: what every host needs, and the front end alone."""
    return sorted(f for f in files if "/" not in f and _matches(f, META_PATTERNS))


def weight_files(files: Iterable[str]) -> list[str]:
    return sorted(f for f in files if "/" not in f and fnmatch.fnmatch(f, WEIGHT_PATTERN))


def files_for(
    files: Iterable[str], weight_map: dict[str, str] | None, layers: Iterable[int] | None
) -> list[str]:
    """The files of a repo listing (``files``) a host loading ``layers`` needs.

    ``layers`` None: every layer (one rank, or tensor parallel: every rank holds a
    slice of every layer). ``weight_map`` is the index's (tensor -> shard); without
    one (a single model.safetensors) the host needs every weight file.
    """
    files = list(files)
    weights = weight_files(files)
    if layers is not None and weight_map:
        wanted = set(layers)
        shards = {
            shard
            for tensor, shard in weight_map.items()
            if (layer_of(tensor) is None or layer_of(tensor) in wanted)
        }
        weights = [w for w in weights if w in shards]
    return sorted({*meta_files(files), *weights})


def rank_layers(layers: int, split: list[int] | None, ranks: int, rank: int) -> range:
    """The decoder layers pipeline rank ``rank`` runs, as mlx-lm's pipeline places them:
    rank 0 the LAST ones; ``split`` lists layers per rank, rank 0 first (None: even,
    the low ranks taking the extra layers). exokv.model.pipeline's own rule, which
    the ranks load by."""
    start, end = local_range(split or even_split(layers, ranks), rank)
    return range(start, end)


def host_layers(
    config: dict[str, Any],
    weight_map: dict[str, str] | None,
    split: list[int] | None,
    ranks: int,
    host_ranks: Iterable[int],
    parallel: str,
) -> set[int] | None:
    """The layers the ranks ``host_ranks`` of one host load; None: all of them."""
    if ranks <= 1 or parallel == "tensor":
        return None
    count = config.get("num_hidden_layers")
    if not isinstance(count, int):
        found = [layer_of(t) for t in weight_map or {}]
        count = max((n for n in found if n is not None), default=-1) + 1
    if count <= 0 or (split is not None and (len(split) != ranks or sum(split) != count)):
        return None  # a split that does not fit: the ranks' loading says so, in one line
    return {n for r in host_ranks for n in rank_layers(count, split, ranks, r)}


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


# -- the cache -----------------------------------------------------------------------------


def cached_commit(repo: str, revision: str | None) -> str | None:
    """The commit ``revision`` names in the cache (refs/<revision>), if known here."""
    rev = revision or DEFAULT_REVISION
    if COMMIT.match(rev):
        return rev if (storage_dir(repo) / "snapshots" / rev).is_dir() else None
    try:
        commit = (storage_dir(repo) / "refs" / rev).read_text().strip()
    except OSError:
        return None
    return commit if COMMIT.match(commit) else None


def snapshot_dir(repo: str, commit: str) -> Path:
    return storage_dir(repo) / "snapshots" / commit


def cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The cached snapshot of ``revision`` if it has a config.json; None otherwise."""
    commit = cached_commit(repo, revision)
    if commit is None:
        return None
    path = snapshot_dir(repo, commit)
    return path if (path / "config.json").is_file() else None


def kept_path(repo: str, commit: str, what: str = "") -> Path:
    """A file of exokv's beside the repo's cache, about ``commit``: the hub's listing of
    its files (``what`` ""), or what else was asked of the hub once (``what`` "tensors":
    the safetensors headers' sizes, for placement). A commit never changes, so they
    never go stale."""
    return storage_dir(repo) / _LISTING_DIR / f"{commit}{'.' + what if what else ''}.json"


def keep(repo: str, commit: str, what: str, data: Any) -> None:
    _write_text(kept_path(repo, commit, what), json.dumps(data))


def read_listing(repo: str, commit: str) -> dict[str, int] | None:
    """The repo's files at ``commit`` (name -> size) as the hub listed them, if kept here."""
    try:
        data = json.loads(kept_path(repo, commit).read_text())
        return {str(k): int(v) for k, v in data["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_text(path: Path, text: str) -> None:
    """Written whole or not at all: another host's reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def folder_listing(folder: Path) -> dict[str, int]:
    """A model folder's files as a listing (name -> 0: sizes unknown): those in it, and
    the shards its index names (a host's snapshot may hold only some of them)."""
    listing = {p.name: 0 for p in folder.iterdir()}
    listing.update(dict.fromkeys((weight_map_of(folder) or {}).values(), 0))
    return listing


def weight_map_of(snapshot: Path) -> dict[str, str] | None:
    try:
        index = json.loads((snapshot / INDEX).read_text())
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return weight_map if isinstance(weight_map, dict) else None


def _config(snapshot: Path) -> dict[str, Any]:
    try:
        config = json.loads((snapshot / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


# -- fetching ------------------------------------------------------------------------------


@dataclass
class Want:
    """What one host loads: its ranks among ``ranks`` (None: the front end, which needs
    config and tokenizer only)."""

    ranks: int = 1
    host_ranks: list[int] | None = field(default_factory=lambda: [0])
    split: list[int] | None = None
    parallel: str = "pipeline"

    def files(self, listing: Iterable[str], snapshot: Path) -> list[str]:
        """The files of ``listing`` this host needs; reads the snapshot's config and index."""
        if self.host_ranks is None:
            return meta_files(listing)
        weight_map = weight_map_of(snapshot)
        layers = host_layers(
            _config(snapshot), weight_map, self.split, self.ranks, self.host_ranks, self.parallel
        )
        return files_for(listing, weight_map, layers)


@dataclass
class Fetched:
    path: Path  # the snapshot
    commit: str
    fetched: list[str]  # files downloaded now (empty: all were here)
    bytes: int  # their size
    files: list[str]  # every file this host needs, all in the snapshot now


def fetch(
    repo: str,
    revision: str | None,
    want: Want | None = None,
    *,
    commit: str | None = None,
    progress: Progress | None = None,
    bars: bool = True,
    dry_run: bool = False,
) -> Fetched:
    """Make the snapshot of ``repo`` at ``revision`` hold what ``want`` needs; one line on failure.

    ``commit`` pins the commit the revision names (the front end resolves it once, so
    every host fetches the same one). ``progress`` gets events: ``plan`` (the files to
    fetch and their bytes), ``bytes`` (done/total) and ``file`` (one finished).
    ``bars``: huggingface_hub's own progress bars on stderr. ``dry_run``: the weight
    files are not fetched, ``fetched`` and ``bytes`` say what would be (config,
    tokenizer and index files are: they say which shards a host needs).
    """
    want = want or Want()
    rev = revision or DEFAULT_REVISION
    commit = commit or (rev if COMMIT.match(rev) else None) or cached_commit(repo, rev)
    listing = read_listing(repo, commit) if commit else None
    if listing is not None and commit is not None:
        done = _present(repo, commit, want, listing)
        if done is not None:
            write_ref(repo, rev, commit)
            return Fetched(snapshot_dir(repo, commit), commit, [], 0, done)
    if offline():
        kept = _cache_only(repo, rev, want)
        if kept is not None:
            return kept
        raise ExokvError(
            f"model '{repo}' not found in the Hugging Face cache ({hf_cache_dir()}) with every "
            f"file this host needs, and HF_HUB_OFFLINE is set: unset it, or download the "
            f"model first with `hf download {repo}`"
            + (f" --revision {revision}" if revision else "")
        )
    if listing is None or commit is None:
        try:
            commit, listing = _ask_hub(repo, rev, commit)
        except _Unreachable:
            kept = _cache_only(repo, rev, want)
            if kept is None:
                raise
            return kept
        _write_text(kept_path(repo, commit), json.dumps({"repo": repo, "files": listing}, indent=1))
    snapshot = snapshot_dir(repo, commit)
    meta = [f for f in meta_files(listing) if not (snapshot / f).is_file()]
    _download(repo, commit, meta, listing, None, bars)  # the index says which shards to fetch
    needed = want.files(listing, snapshot)
    missing = [f for f in needed if not (snapshot / f).is_file()]
    total = sum(listing.get(f, 0) for f in missing)
    if dry_run:
        return Fetched(snapshot, commit, missing, total, needed)
    if progress is not None:
        progress({"event": "plan", "files": missing, "bytes": total, "commit": commit})
    _download(repo, commit, missing, listing, progress, bars)
    write_ref(repo, rev, commit)
    return Fetched(snapshot, commit, meta + missing, total + _size(listing, meta), needed)


def _cache_only(repo: str, revision: str, want: Want) -> Fetched | None:
    """The cached snapshot, when the hub cannot be asked and it holds what ``want`` needs
    as far as the snapshot itself tells (its files, and the shards its index names):
    a snapshot `hf download` made has no listing of ours."""
    snapshot = cached_snapshot(repo, revision)
    if snapshot is None:
        return None
    needed = want.files(folder_listing(snapshot), snapshot)
    if not all((snapshot / f).is_file() for f in needed):
        return None
    return Fetched(snapshot, snapshot.name, [], 0, needed)


class _Unreachable(ExokvError):
    """The hub could not be reached (the cache may still serve)."""


def _size(listing: dict[str, int], files: Iterable[str]) -> int:
    return sum(listing.get(f, 0) for f in files)


def _present(repo: str, commit: str, want: Want, listing: dict[str, int]) -> list[str] | None:
    """Every file ``want`` needs, when all are in the snapshot; None when one is not."""
    snapshot = snapshot_dir(repo, commit)
    if not all((snapshot / f).is_file() for f in meta_files(listing)):
        return None
    needed = want.files(listing, snapshot)
    return needed if all((snapshot / f).is_file() for f in needed) else None


def write_ref(repo: str, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, as huggingface_hub keeps it: ranks look the revision up there."""
    if COMMIT.match(revision):
        return
    ref = storage_dir(repo) / "refs" / revision
    try:
        if ref.read_text().strip() == commit:
            return
    except OSError:
        pass
    _write_text(ref, commit)


def _ask_hub(repo: str, revision: str, commit: str | None) -> tuple[str, dict[str, int]]:
    """(commit, {file: size}) of ``revision`` from the hub; one line naming what failed."""
    from huggingface_hub import HfApi  # deferred: hf_api (~0.2 s) only to ask the hub

    try:
        info = HfApi(endpoint=endpoint()).model_info(
            repo, revision=commit or revision, files_metadata=True
        )
    except Exception as err:  # noqa: BLE001 - turned into one line below
        raise hub_error(err, repo, revision) from err
    if not info.sha or not COMMIT.match(info.sha):
        raise ExokvError(f"the hub at {endpoint()} gave no commit for {repo} at {revision!r}")
    files = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    return info.sha, files


def hub_error(err: BaseException, repo: str, revision: str | None, file: str = "") -> ExokvError:
    """One line for what huggingface_hub raised while reaching ``repo``."""
    # deferred: httpx2 and huggingface_hub.errors (~0.2 s) only after the hub failed
    import httpx2
    from huggingface_hub import errors

    where = endpoint()
    unreachable = (
        httpx2.TransportError,
        errors.OfflineModeIsEnabled,
        errors.LocalEntryNotFoundError,
    )
    if isinstance(err, unreachable) or (
        isinstance(err, OSError) and not isinstance(err, errors.HfHubHTTPError)
    ):
        what = f" (downloading {file})" if file else ""
        return _Unreachable(
            f"model '{repo}' not found whole in the Hugging Face cache, and cannot reach the "
            f"hub at {where}{what}: {one_line(err)}"[:300]
            + "; check the network (or HF_ENDPOINT), then run again: finished files are kept"
        )
    if isinstance(err, errors.RevisionNotFoundError):
        return ExokvError(f"model '{repo}' has no revision {revision!r} on the hub at {where}")
    if isinstance(err, errors.EntryNotFoundError):
        return ExokvError(f"model '{repo}': the hub at {where} has no file {file!r}")
    if isinstance(err, errors.GatedRepoError):
        return ExokvError(
            f"model '{repo}' is gated on the hub at {where}: accept its terms on the hub and "
            "log in on this host with `hf auth login` (or set HF_TOKEN in its environment)"
        )
    if isinstance(err, errors.RepositoryNotFoundError):
        return ExokvError(
            f"model '{repo}' not found on the hub at {where} (no such repo, or a private one: "
            "log in with `hf auth login`)"
        )
    if isinstance(err, errors.HfHubHTTPError):
        status = err.response.status_code if err.response is not None else "?"
        return ExokvError(f"the hub at {where} answered {status} for model '{repo}'")
    return ExokvError(f"could not fetch model '{repo}' from {where}: {one_line(err)}"[:400])


def _download(
    repo: str,
    commit: str,
    files: list[str],
    listing: dict[str, int],
    progress: Progress | None,
    bars: bool,
) -> None:
    # deferred: huggingface_hub's file_download (~0.1 s) only to download
    from huggingface_hub import hf_hub_download

    total = _size(listing, files)
    done = 0
    for name in files:
        bar = None if bars or progress is None else _reporting_bar(progress, done, total)
        try:
            hf_hub_download(
                repo,
                name,
                revision=commit,
                cache_dir=str(hf_cache_dir()),
                endpoint=endpoint(),
                tqdm_class=bar,
            )
        except Exception as err:  # noqa: BLE001 - turned into one line
            raise hub_error(err, repo, commit, name) from err
        done += listing.get(name, 0)
        if progress is not None:
            progress({"event": "file", "name": name, "done": done, "total": total})


def _reporting_bar(progress: Progress, before: int, total: int) -> type:
    """A tqdm class for huggingface_hub that reports bytes to ``progress`` instead of drawing."""
    from tqdm import tqdm  # deferred: tqdm (~50 ms) only while downloading

    class Reporting(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.got = 0
            self.said = 0.0

        def update(self, n: float | None = 1) -> bool | None:
            self.got += int(n or 0)
            now = time.monotonic()
            if now - self.said >= 0.25:  # a line 4 times a second at most
                self.said = now
                progress({"event": "bytes", "done": before + self.got, "total": total})
            return None

    return Reporting
