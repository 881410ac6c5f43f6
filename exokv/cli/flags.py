"""The flags `exokv chat` and `exokv serve` share, each defined once.

The two front ends start the same ranks the same way, so a flag of the model, the
layout or the cache must read alike in both: same name, default, help and completion.
Typer takes a command's options from its signature, so each command still names its
parameters, with one of these as the default; `passed_on` then hands the values that
go to `ChatOptions` unchanged over by those names, so a new shared flag is added here,
in both signatures and in `ChatOptions`, and nowhere else. (`exokv bench` reuses the
ones it has alike.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import typer

MODEL = typer.Option(
    None,
    "--model",
    "-m",
    help="smollm2 (default), builtin:NAME, a path, a .gguf, ollama:NAME or a HF repo id",
)
SYSTEM = typer.Option(None, "--system", help="system prompt")
CHAT_TEMPLATE = typer.Option(
    None,
    "--chat-template",
    help="chatml|llama3|gemma|mistral|qwen|phi|plain or a Jinja file (default: the model's)",
)
# The chat's words for these two; `serve` words its own for a request that sets none.
MAX_TOKENS = typer.Option(256, "--max-tokens", help="most tokens per reply")
TEMP = typer.Option(
    None, "--temp", help="sampling temperature (default 0, or an ollama model's own)"
)
SEED = typer.Option(None, "--seed", help="random seed")
RANKS = typer.Option(1, "--ranks", "-n", help="ranks on this machine")
HOSTS = typer.Option(None, "--hosts", help="a,b,... one rank per host")
HOSTFILE = typer.Option(None, "--hostfile", help="mlx hostfile (JSON)")
BACKEND = typer.Option("ring", "--backend", help="ring|jaccl|mpi")
PARALLEL = typer.Option("pipeline", "--parallel", help="pipeline|tensor")
SPLIT = typer.Option(
    None, "--split", help="layers per rank: auto (from memory; the default) or e.g. 3,1"
)
PLAN = typer.Option(
    False, "--plan", help="print where the layers and cache go, then exit (loads no weights)"
)
CACHE_BUDGET = typer.Option(None, "--cache-budget", help="bytes per rank: 2GB or 64MB,16MB")
MEMORY_THRESHOLD = typer.Option(
    0.9, "--memory-threshold", help="RAM fraction that triggers eviction"
)
MAX_KV_SIZE = typer.Option(None, "--max-kv-size", help="rotating KV cache of this many tokens")
NO_CACHE = typer.Option(False, "--no-cache", help="prefill the whole prompt every turn")
DISK_BUDGET = typer.Option(
    None, "--disk-budget", help="disk tier per rank: 20GB, auto (a share of free space) or 0"
)
KV_BITS = typer.Option(None, "--kv-bits", help="quantized KV cache: 4 or 8 bits")
KV_GROUP_SIZE = typer.Option(64, "--kv-group-size", help="quantization group size")
NO_SPECULATE = typer.Option(
    False, "--no-speculate", help="decode one token at a time, no drafts from the conversation"
)
STARTING_PORT = typer.Option(None, "--starting-port", help="first port for the ranks")
DRAFT_MODEL = typer.Option(
    None,
    "--draft-model",
    help="a small model with the model's tokenizer that drafts replies on rank 0 (as --model)",
)
RESTARTS = typer.Option(
    3, "--restarts", help="a rank that dies: start the ranks again, up to N tries (0: end)"
)
REPLICAS = typer.Option(
    None,
    "--replicas",
    help="copies of each rank's disk cache on another host: 0 or 1 (1 over several hosts)",
    show_default=False,
)

# The flags whose values go to ChatOptions as given, under their parameter's name. The
# others (the model, system prompt, template, reply length and temperature) are settled
# first by the command: a stored session or an ollama model may supply them.
PASSED_ON = (
    SEED,
    REPLICAS,
    RANKS,
    HOSTS,
    HOSTFILE,
    BACKEND,
    PARALLEL,
    SPLIT,
    PLAN,
    CACHE_BUDGET,
    MEMORY_THRESHOLD,
    NO_CACHE,
    NO_SPECULATE,
    DISK_BUDGET,
    KV_BITS,
    KV_GROUP_SIZE,
    STARTING_PORT,
    RESTARTS,
    DRAFT_MODEL,
)


def passed_on(command: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """Among a command's parameter `values` (its `locals()`), those whose flag is in
    PASSED_ON, by name: found from the signature, so no list of names can drift from it."""
    params = inspect.signature(command).parameters.values()
    return {p.name: values[p.name] for p in params if any(p.default is f for f in PASSED_ON)}
