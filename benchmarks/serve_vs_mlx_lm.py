"""`exokv serve` against `mlx_lm.server`: the same model, the same workloads, one run.

    python benchmarks/serve_vs_mlx_lm.py --model builtin:base --repeats 3
    python benchmarks/serve_vs_mlx_lm.py --model builtin:base --repeats 3 --ranks 2

Both servers run on --ranks ranks on this machine (2: pipeline ranks, `exokv serve -n 2`
against `mlx.launch -n 2 --backend ring ... mlx_lm.server --pipeline`, which loads the
model with `sharded_load`), both up at once but measured in turn: trials alternate
between them, so the noise of a shared machine falls on both alike. On 2 ranks
mlx_lm.server's rank 1 busy-waits a core while idle: its process group is stopped
(SIGSTOP) while another server is measured and continued for its own trials. Each is
driven by the real `openai` client:

1. **Decode throughput**: 8 streams at once, each its own prompt, `--max-tokens`
   tokens at temperature 0. Aggregate tokens/s = all completion tokens / the wall
   time from the first request to the last token. Median of --repeats.
2. **Returning conversation**: conversations with a long system prompt, turn after
   turn (each call resends the whole history, as clients do); time to first token
   (the first content chunk of the stream) of every turn after the first. Median.
3. **Cache bytes**: --clients clients x --turns turns (a shared system prompt, each
   its own history), 8 at a time; each server's prompt-cache bytes before and after
   it, per rank: the workload's figure is what it added (after - before).
   exokv: each rank's cache bytes (`exokv cache stats --json`, RAM + disk tier);
   mlx_lm.server: each rank's LRUPromptCache `nbytes` (a pipeline rank's cache holds
   its own layers only, as an exokv rank's does), written by each rank to a file
   after every change by a wrapper (this script, `--mlx-lm-probe`) that runs
   `mlx_lm.server.main()` as is. mlx_lm.server's `--prompt-cache-size` is every
   sequence the run sends (`mlx_lm_cache_size`) so it evicts nothing, as exokv,
   which runs without a budget limit, does not.

A server that does not start ends the script with one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SYSTEM = (
    "You are a careful assistant for a team that writes software for a cluster of small "
    "computers. Answer in plain words, keep answers short, name the files you mean, and "
    "say when you are unsure. "
) * 6


START_TIMEOUT_S = 300
PORT_BLOCK = 10  # ring ports per server: --starting-port + 10 x its place


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (with its ranks, in a process group of its own), its stderr
    kept; stopped with SIGTERM, and whatever of its group is left then with SIGKILL."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], ready: str, launched: bool = False
    ) -> None:
        self.name = name
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE if launched else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # mlx.launch's ranks are stopped with it
        )
        self.log: list[str] = []
        self._client: Any = None
        self.paused = False
        # Paused while another server is measured: mlx_lm.server's pipeline ranks
        # other than 0 busy-wait a whole core while idle (measured here).
        self.pause_when_idle = False
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(ready in x for x in self.log):
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                why = f"exit {code}" if code is not None else f"not ready in {START_TIMEOUT_S} s"
                last = next((x for x in reversed(self.log) if x.strip()), "no output")
                raise SystemExit(f"serve_vs_mlx_lm: {name} did not start ({why}): {last}")
            time.sleep(0.1)
        time.sleep(0.5)
        if launched:
            self._quiet_launcher()

    def _quiet_launcher(self) -> None:
        """mlx.launch's thread per rank polls that rank's stdin, always writable, in a busy
        loop until a write to it fails: a core taken from the ranks. The probe's ranks
        closed their stdin as they started, so a byte sent through now fails."""
        assert self.proc.stdin is not None
        for _ in range(2):
            try:
                self.proc.stdin.write(b"\n")
                self.proc.stdin.flush()
            except OSError:
                return
            time.sleep(0.2)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in iter(self.proc.stderr.readline, b""):
            self.log.append(line.decode(errors="replace").rstrip())

    def client(self) -> Any:
        """One OpenAI client per server, shared by the threads (its httpx pool is
        thread-safe): making one per request costs the load generator tens of ms of
        the cores the servers run on, and spreads the arrival of "concurrent" requests."""
        if self._client is None:
            from openai import OpenAI

            self._client = OpenAI(
                base_url=f"http://127.0.0.1:{self.port}/v1",
                api_key="none",
                max_retries=0,
                timeout=1800,  # a heavy workload on two ranks here keeps some requests past 600 s
            )
        return self._client

    def pause(self) -> None:
        """Stop the whole process group from running (SIGSTOP): see `measure`."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def stop(self) -> None:
        try:
            self.resume()
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        try:  # ranks the launcher left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def running_alone(server: Server, servers: dict[str, tuple[Server, str]]) -> Server:
    """`server`, running; any other server that spins while idle, paused (the cores are
    the one being measured's, as on machines of its own)."""
    for other, _ in servers.values():
        if other is not server and other.pause_when_idle and not other.paused:
            other.pause()
    server.resume()
    return server


def warm_up(servers: dict[str, tuple[Server, str]]) -> None:
    """One short request to each server, alone, before anything is timed."""
    for server, model in servers.values():
        stream_turn(
            running_alone(server, servers), model, [{"role": "user", "content": "warm up"}], 8
        )


def stream_turn(server: Server, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed completion: its text, completion tokens, TTFT, each content chunk's
    arrival and the end time."""
    sent = time.perf_counter()
    first = None
    parts = []
    chunks: list[float] = []
    used = None
    for chunk in server.client().chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(time.perf_counter())
            if first is None:
                first = chunks[-1]
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            used = chunk.usage
    end = time.perf_counter()
    return {
        "text": "".join(parts),
        "tokens": used.completion_tokens if used else len(parts),
        "cached": (
            used.prompt_tokens_details.cached_tokens if used and used.prompt_tokens_details else 0
        )
        or 0,
        "prompt": used.prompt_tokens if used else 0,
        "ttft": (first or end) - sent,
        "sent": sent,
        "chunks": chunks,
        "end": end,
    }


def throughput(server: Server, model: str, streams: int, max_tokens: int, trial: int) -> float:
    prompts = [
        [{"role": "user", "content": f"trial {trial}: write about machine number {i} in the rack"}]
        for i in range(streams)
    ]
    with ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(lambda m: stream_turn(server, model, m, max_tokens), prompts))
    wall = max(r["end"] for r in runs) - min(r["sent"] for r in runs)
    return sum(r["tokens"] for r in runs) / wall


def returning(server: Server, model: str, turns: int, trial: int) -> list[float]:
    messages = [{"role": "system", "content": SYSTEM + f" (conversation {trial})"}]
    ttfts = []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"question {turn}: what does file {turn}.py do?"}
        )
        run = stream_turn(server, model, messages, 24)
        if turn:
            ttfts.append(run["ttft"])
        messages.append({"role": "assistant", "content": run["text"]})
    return ttfts


def many_clients(server: Server, model: str, clients: int, turns: int) -> None:
    def conversation(c: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"client {c}, turn {turn}: hello again"})
            run = stream_turn(server, model, messages, 16)
            messages.append({"role": "assistant", "content": run["text"]})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(conversation, range(clients)))


def exokv_cache_bytes(home: Path) -> list[dict[str, int]]:
    """Each rank's cache bytes (RAM and disk tier) and entries, rank 0 first."""
    out = subprocess.run(
        [sys.executable, "-m", "exokv", "cache", "stats", "--json"],
        env={**os.environ, "EXOKV_HOME": str(home)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ranks = sorted(json.loads(out)["ranks"], key=lambda r: r.get("rank", 0))
    return [
        {"bytes": r["bytes"] + r.get("disk_bytes", 0), "entries": r.get("entries", -1)}
        for r in ranks
    ]


PROBE_DIR = "SERVE_BENCH_PROBE_DIR"  # where each mlx_lm.server rank writes its figures


def mlx_lm_cache_bytes(probe_dir: Path, ranks: int) -> list[dict[str, int]]:
    """Each rank's last reported prompt-cache bytes and sequences, rank 0 first (-1:
    none reported)."""
    time.sleep(1.0)  # the last request's insert, on every rank
    out = []
    for rank in range(ranks):
        try:
            out.append(json.loads((probe_dir / f"rank{rank}.json").read_text()))
        except FileNotFoundError:
            out.append({"bytes": -1, "entries": -1})
    return out


def mlx_lm_probe() -> None:
    """Run mlx_lm.server as it is; after every insert into or trim of its prompt cache,
    this rank writes the cache's exact bytes and sequences to a file of its own (its
    log line rounds them to 0.01 GB, comes before the request's insert and does not
    say the rank; and mlx.launch interleaves the ranks' stderr mid-line)."""
    import mlx.core as mx
    import mlx_lm.server as server
    from mlx_lm.models.cache import LRUPromptCache

    group = mx.distributed.init()
    if group.size() > 1:  # see Server._quiet_launcher
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    target = Path(os.environ[PROBE_DIR]) / f"rank{group.rank()}.json"
    scratch = target.with_suffix(".tmp")

    def reporting(change: Any) -> Any:
        def changed(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = change(self, *args, **kwargs)
            scratch.write_text(json.dumps({"bytes": self.nbytes, "entries": len(self)}))
            scratch.replace(target)
            return out

        return changed

    LRUPromptCache.insert_cache = reporting(LRUPromptCache.insert_cache)
    LRUPromptCache.trim_to = reporting(LRUPromptCache.trim_to)
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    server.main()


def measure(
    servers: dict[str, tuple[Server, str]], args: argparse.Namespace, cache_bytes: Any
) -> dict[str, Any]:
    """Trials alternate between the servers (both are up; the idle one waits), so the
    noise of a shared machine falls on both alike. Then the many-clients workload, with
    each server's cache read before and after it (`cache_bytes(name)`)."""
    out: dict[str, Any] = {name: {"decode_tps": [], "returning_ttft_s": []} for name in servers}

    def only(server: Server) -> Server:
        return running_alone(server, servers)

    warm_up(servers)
    for trial in range(args.repeats):
        for name, (server, model) in servers.items():
            tps = throughput(only(server), model, args.streams, args.max_tokens, trial)
            out[name]["decode_tps"].append(tps)
        for name, (server, model) in servers.items():
            out[name]["returning_ttft_s"] += returning(only(server), model, args.conv_turns, trial)
    for name, (server, model) in servers.items():
        if name == "exokv_serial":  # its cache holds what the batched one's does
            continue
        only(server)
        out[name]["cache_before_clients"] = cache_bytes(name)
        many_clients(server, model, args.clients, args.turns)
        out[name]["cache_after_clients"] = cache_bytes(name)
    return out


def requests_by_batch(log: list[str]) -> dict[int, int]:
    """How many requests exokv decoded in a batch of each size (its access log's
    `batch=N`; no `batch=` is 1)."""
    sizes: dict[int, int] = {}
    for line in log:
        if " POST /v1/chat/completions " in line:
            found = re.search(r" batch=(\d+)", line)
            size = int(found.group(1)) if found else 1
            sizes[size] = sizes.get(size, 0) + 1
    return dict(sorted(sizes.items()))


def mlx_lm_cache_size(args: argparse.Namespace) -> int:
    """Sequences mlx_lm.server may keep: one per request of the run (it keeps a cache per
    finished request, and a later turn's does not replace the earlier turn's), with room
    to spare, so that none is evicted."""
    requests = 1 + args.repeats * (args.streams + args.conv_turns) + args.clients * args.turns
    return requests + 16


def cache_figures(r: dict[str, Any]) -> dict[str, Any]:
    """Bytes per rank after the whole run, and what the many-clients workload added
    (after - before; -1 where a rank reported nothing)."""
    after = [x["bytes"] for x in r["cache_after_clients"]]
    before = [x["bytes"] for x in r["cache_before_clients"]]
    added = [a - b if min(a, b) >= 0 else -1 for a, b in zip(after, before, strict=True)]
    return {
        "cache_bytes_per_rank": after,
        "cache_bytes": sum(after) if min(after) >= 0 else -1,
        "clients_cache_bytes_per_rank": added,
        "clients_cache_bytes": sum(added) if min(added) >= 0 else -1,
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 (argparse adds the usage)
        self.exit(2, f"serve_vs_mlx_lm: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:base")
    p.add_argument("--ranks", type=int, default=1, help="ranks of each server (2+: pipeline)")
    p.add_argument(
        "--starting-port",
        type=int,
        default=28000,
        help="first ring port of the ranks (each server takes a block of 10 from here)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--conv-turns", type=int, default=4)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="exokv serve --batch (rows at most)")
    p.add_argument(
        "--serial", action="store_true", help="also measure exokv serve --batch 1 (one at a time)"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("ranks", "repeats", "streams", "max_tokens", "clients", "turns", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    if args.conv_turns < 2:
        p.error(f"--conv-turns {args.conv_turns}: at least 2 (the first turn is not returning)")
    if args.ranks > PORT_BLOCK:
        p.error(f"--ranks {args.ranks}: at most {PORT_BLOCK} on one machine")
    last = args.starting_port + 3 * PORT_BLOCK - 1
    if args.starting_port < 1024 or last > 65535:
        p.error(f"--starting-port {args.starting_port}: use 1024-{65536 - 3 * PORT_BLOCK}")
    return args


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--mlx-lm-probe":
        mlx_lm_probe()
        return
    args = parse_args()

    from exokv.config import exokv_home
    from exokv.errors import ExokvError
    from exokv.model.resolve import resolve_model

    home = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    serial_home = Path(tempfile.mkdtemp(prefix="serve-bench-serial-"))
    try:
        source = exokv_home()
        if (source / "models").exists() and source != home:
            (home / "models").symlink_to(source / "models", target_is_directory=True)
        os.environ["EXOKV_HOME"] = str(home)
        try:
            path = resolve_model(args.model)  # generated once, loaded by both servers
        except ExokvError as err:
            raise SystemExit(f"serve_vs_mlx_lm: {err}") from None
        (serial_home / "models").symlink_to(home / "models", target_is_directory=True)
        results = run(args, path, home, serial_home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(serial_home, ignore_errors=True)
    report(results, args.json)


def run(args: argparse.Namespace, path: Path, home: Path, serial_home: Path) -> dict[str, Any]:
    """Start the servers, measure them in turn, stop them; each server's ring ports are
    a block of its own from --starting-port."""
    from exokv.launch.command import launcher

    env = {**os.environ, "EXOKV_HOME": str(home)}
    ranks = args.ranks
    results: dict[str, Any] = {"model": args.model, "args": vars(args)}
    results["load_average_before"] = os.getloadavg()

    def exokv_argv(block: int, batch: int) -> list[str]:
        argv = [sys.executable, "-m", "exokv", "serve", "--model", args.model, "-n", str(ranks)]
        argv += ["--port", "{port}", "--disk-budget", "0", "--queue", "256"]
        if ranks > 1:
            argv += ["--starting-port", str(args.starting_port + block * PORT_BLOCK)]
        return [*argv, "--batch", str(batch)]

    mlx_argv = [sys.executable, str(Path(__file__).resolve()), "--mlx-lm-probe"]
    mlx_argv += ["--model", str(path), "--port", "{port}", "--log-level", "INFO"]
    mlx_argv += ["--prompt-cache-size", str(mlx_lm_cache_size(args))]
    if ranks > 1:
        launch = [launcher(), "-n", str(ranks), "--backend", "ring"]
        launch += ["--starting-port", str(args.starting_port + PORT_BLOCK), "--"]
        mlx_argv = [*launch, *mlx_argv, "--pipeline"]
    started: list[Server] = []
    try:
        exokv = Server("exokv", exokv_argv(0, args.batch), env, "serving ")
        started.append(exokv)
        probe_dir = home / "mlx-lm-probe"
        probe_dir.mkdir()
        mlx_env = {**env, PROBE_DIR: str(probe_dir)}
        mlx = Server("mlx_lm.server", mlx_argv, mlx_env, "Starting httpd", launched=ranks > 1)
        started.append(mlx)
        mlx.pause_when_idle = ranks > 1
        servers = {"exokv": (exokv, args.model), "mlx_lm": (mlx, "default_model")}
        if args.serial:  # its own home: its cache is not the batched server's
            serial_env = {**env, "EXOKV_HOME": str(serial_home)}
            serial = Server("exokv --batch 1", exokv_argv(2, 1), serial_env, "serving ")
            started.append(serial)
            servers["exokv_serial"] = (serial, args.model)

        def cache_bytes(name: str) -> list[dict[str, int]]:
            if name == "exokv":
                return exokv_cache_bytes(home)
            return mlx_lm_cache_bytes(probe_dir, ranks)

        try:
            results.update(measure(servers, args, cache_bytes))
        except Exception as err:  # a server that died mid-run: one line, exit 1
            raise SystemExit(f"serve_vs_mlx_lm: the run failed: {err!r}") from None
        for name in ("exokv", "mlx_lm"):
            results[name].update(cache_figures(results[name]))
        if any(x for x in exokv.log if "batches are decoded on one rank only" in x):
            results["exokv"]["batch_fell_back_to_1"] = True
        for name, (server, _) in servers.items():
            if name.startswith("exokv"):
                results[name]["requests_by_batch"] = requests_by_batch(server.log)
    finally:
        for server in reversed(started):
            server.stop()
    results["load_average_after"] = os.getloadavg()
    return results


CACHE_KEYS = ("clients_cache_bytes", "clients_cache_bytes_per_rank", "cache_bytes")


def report(results: dict[str, Any], as_json: bool) -> None:
    summary: dict[str, dict[str, Any]] = {}
    for name in ("exokv", "mlx_lm", "exokv_serial"):
        if name not in results:
            continue
        r = results[name]
        summary[name] = {
            "decode_tps_median": statistics.median(r["decode_tps"]),
            "returning_ttft_s_median": statistics.median(r["returning_ttft_s"]),
            **{k: r[k] for k in CACHE_KEYS if k in r},
        }
    results["summary"] = summary
    e, m = summary["exokv"], summary["mlx_lm"]

    def over(key: str) -> float | None:
        return e[key] / m[key] if m[key] > 0 and e[key] >= 0 else None

    results["ratios"] = {
        "decode_tps_exokv_over_mlx_lm": over("decode_tps_median"),
        "returning_ttft_exokv_over_mlx_lm": over("returning_ttft_s_median"),
        "clients_cache_bytes_exokv_over_mlx_lm": over("clients_cache_bytes"),
        "clients_cache_bytes_per_rank_exokv_over_mlx_lm": [
            x / y if y > 0 and x >= 0 else None
            for x, y in zip(
                e["clients_cache_bytes_per_rank"], m["clients_cache_bytes_per_rank"], strict=True
            )
        ],
        "cache_bytes_after_run_exokv_over_mlx_lm": over("cache_bytes"),
    }
    if "exokv_serial" in summary:  # one at a time, beside the batched server
        results["ratios"]["decode_tps_batched_over_serial"] = (
            e["decode_tps_median"] / summary["exokv_serial"]["decode_tps_median"]
        )
    if as_json:
        print(json.dumps(results, indent=2))
        return
    ranks = results["args"]["ranks"]
    print(f"{ranks} rank(s); load average before {results['load_average_before']}")
    print(
        f"{'server':<13} {'decode tok/s':>13} {'returning TTFT':>15} "
        f"{'cache bytes, clients':>21}  per rank"
    )
    for name, row in summary.items():
        size = row.get("clients_cache_bytes", -1)
        shown = f"{size:,}" if size >= 0 else "-"
        each = " ".join(f"{x:,}" for x in row.get("clients_cache_bytes_per_rank", []))
        tps, ttft = row["decode_tps_median"], row["returning_ttft_s_median"]
        print(f"{name:<13} {tps:>13.1f} {ttft * 1000:>12.1f} ms {shown:>21}  {each}")
    print(json.dumps(results["ratios"]))


if __name__ == "__main__":
    main()
