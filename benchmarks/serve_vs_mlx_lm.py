"""`exokv serve` against `mlx_lm.server`: the same model, the same workloads, one run.

    python benchmarks/serve_vs_mlx_lm.py --model builtin:base --repeats 3

Both servers run on 1 rank on this machine, both up at once but measured in turn:
trials alternate between them, so the noise of a shared machine falls on both alike.
Each is driven by the real `openai` client:

1. **Decode throughput**: 8 streams at once, each its own prompt, `--max-tokens`
   tokens at temperature 0. Aggregate tokens/s = all completion tokens / the wall
   time from the first request to the last token. Median of --repeats.
2. **Returning conversation**: conversations with a long system prompt, turn after
   turn (each call resends the whole history, as clients do); time to first token
   (the first content chunk of the stream) of every turn after the first. Median.
3. **Cache bytes**: --clients clients x --turns turns (a shared system prompt, each
   its own history), 8 at a time; then the bytes each server's prompt cache holds.
   exokv: the ranks' cache bytes (`exokv cache stats --json`, RAM + disk tier);
   mlx_lm.server: its LRUPromptCache's `nbytes`, printed after each request by a
   wrapper (this script, `--mlx-lm-probe`) that runs `mlx_lm.server.main()` as is.
   mlx_lm.server keeps --clients x --turns caches (`--prompt-cache-size`) so both
   keep every conversation; exokv runs without a budget limit.
"""

from __future__ import annotations

import argparse
import json
import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process, its stderr kept, stopped with SIGTERM."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], ready: str) -> None:
        self.name = name
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + 300
        while not any(ready in x for x in self.log):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name} did not start: {self.log[-10:]}")
            time.sleep(0.1)
        time.sleep(0.5)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in iter(self.proc.stderr.readline, b""):
            self.log.append(line.decode(errors="replace").rstrip())

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=600
        )

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stream_turn(server: Server, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed completion: its text, completion tokens, TTFT and end time."""
    sent = time.perf_counter()
    first = None
    parts = []
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
            if first is None:
                first = time.perf_counter()
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


def exokv_cache_bytes(home: Path) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "exokv", "cache", "stats", "--json"],
        env={**os.environ, "EXOKV_HOME": str(home)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ranks = json.loads(out)["ranks"]
    return sum(r["bytes"] + r.get("disk_bytes", 0) for r in ranks)


PROBE_MARK = "mlx-lm-cache-bytes "


def mlx_lm_cache_bytes(server: Server) -> int:
    time.sleep(1.0)  # the last request's log line
    found = [x for x in server.log if x.startswith(PROBE_MARK)]
    return int(found[-1].split()[1]) if found else -1


def mlx_lm_probe() -> None:
    """Run mlx_lm.server as it is, printing its prompt cache's exact bytes after each
    request (its own log line rounds them to 0.01 GB)."""
    import mlx_lm.server as server

    logged = server.ResponseGenerator._log_cache_stats

    def log(self: Any) -> None:
        print(
            f"{PROBE_MARK}{self.prompt_cache.nbytes} {len(self.prompt_cache)}",
            file=sys.stderr,
            flush=True,
        )
        logged(self)

    server.ResponseGenerator._log_cache_stats = log
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    server.main()


def measure(servers: dict[str, tuple[Server, str]], args: argparse.Namespace) -> dict[str, Any]:
    """Trials alternate between the servers (both are up; the idle one waits), so the
    noise of a shared machine falls on both alike."""
    out: dict[str, Any] = {name: {"decode_tps": [], "returning_ttft_s": []} for name in servers}
    for server, model in servers.values():
        stream_turn(server, model, [{"role": "user", "content": "warm up"}], 8)
    for trial in range(args.repeats):
        for name, (server, model) in servers.items():
            tps = throughput(server, model, args.streams, args.max_tokens, trial)
            out[name]["decode_tps"].append(tps)
        for name, (server, model) in servers.items():
            out[name]["returning_ttft_s"] += returning(server, model, args.conv_turns, trial)
    for name, (server, model) in servers.items():
        if name != "exokv_serial":  # its cache holds what the batched one's does
            many_clients(server, model, args.clients, args.turns)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--mlx-lm-probe":
        mlx_lm_probe()
        return
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="builtin:base")
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
    args = p.parse_args()

    from exokv.model.resolve import resolve_model

    home = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    source = Path(os.environ.get("EXOKV_HOME", home))
    if (source / "models").exists() and source != home:
        (home / "models").symlink_to(source / "models", target_is_directory=True)
    env = {**os.environ, "EXOKV_HOME": str(home)}
    os.environ["EXOKV_HOME"] = str(home)
    path = resolve_model(args.model)  # generated once, loaded by both servers

    results: dict[str, Any] = {"model": args.model, "args": vars(args)}
    exokv_argv = [sys.executable, "-m", "exokv", "serve", "--model", args.model]
    exokv_argv += ["--port", "{port}", "--disk-budget", "0", "--queue", "256"]
    serial_argv = [*exokv_argv, "--batch", "1"]
    exokv_argv += ["--batch", str(args.batch)]
    mlx_argv = [sys.executable, __file__, "--mlx-lm-probe", "--model", str(path)]
    mlx_argv += ["--port", "{port}", "--log-level", "INFO"]
    mlx_argv += ["--prompt-cache-size", str(args.clients * args.turns + 16)]
    exokv = Server("exokv", exokv_argv, env, "serving ")
    serial = None
    try:
        mlx = Server("mlx_lm.server", mlx_argv, env, "Starting httpd")
        servers = {"exokv": (exokv, args.model), "mlx_lm": (mlx, "default_model")}
        if args.serial:  # its own home: its cache is not the batched server's
            serial_home = Path(tempfile.mkdtemp(prefix="serve-bench-serial-"))
            (serial_home / "models").symlink_to(home / "models", target_is_directory=True)
            serial_env = {**env, "EXOKV_HOME": str(serial_home)}
            serial = Server("exokv --batch 1", serial_argv, serial_env, "serving ")
            servers["exokv_serial"] = (serial, args.model)
        try:
            results.update(measure(servers, args))
            results["exokv"]["cache_bytes"] = exokv_cache_bytes(home)
            results["mlx_lm"]["cache_bytes"] = mlx_lm_cache_bytes(mlx)
        finally:
            mlx.stop()
            if serial is not None:
                serial.stop()
    finally:
        exokv.stop()
        shutil.rmtree(home, ignore_errors=True)
    report(results, args.json)


def report(results: dict[str, Any], as_json: bool) -> None:
    rows = []
    for key in ("exokv", "mlx_lm"):
        r = results[key]
        rows.append(
            (
                key,
                statistics.median(r["decode_tps"]),
                statistics.median(r["returning_ttft_s"]),
                r["cache_bytes"],
            )
        )
    results["summary"] = {
        name: {"decode_tps_median": tps, "returning_ttft_s_median": ttft, "cache_bytes": size}
        for name, tps, ttft, size in rows
    }
    e, m = rows
    results["ratios"] = {
        "decode_tps_exokv_over_mlx_lm": e[1] / m[1],
        "returning_ttft_exokv_over_mlx_lm": e[2] / m[2],
        "cache_bytes_exokv_over_mlx_lm": e[3] / m[3] if m[3] > 0 else None,
    }
    if "exokv_serial" in results:  # one at a time, beside the batched server
        r = results["exokv_serial"]
        tps, ttft = statistics.median(r["decode_tps"]), statistics.median(r["returning_ttft_s"])
        results["summary"]["exokv_serial"] = {
            "decode_tps_median": tps,
            "returning_ttft_s_median": ttft,
        }
        results["ratios"]["decode_tps_batched_over_serial"] = e[1] / tps
        rows.append(("exokv_serial", tps, ttft, -1))
    if as_json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{'server':<13} {'decode tok/s, 8 streams':>24} {'returning TTFT':>16} {'cache bytes':>14}"
    )
    for name, tps, ttft, size in rows:
        shown = f"{size:,}" if size >= 0 else "-"
        print(f"{name:<13} {tps:>24.1f} {ttft * 1000:>13.1f} ms {shown:>14}")
    print(json.dumps(results["ratios"]))


if __name__ == "__main__":
    main()
