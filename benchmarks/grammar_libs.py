"""Structured output (issue 44): which grammar library masks a token cheapest here.

    python benchmarks/grammar_libs.py --model builtin:tiny --model smollm2 --repeat 5

For each model's tokenizer and each library that imports (llguidance, outlines-core,
xgrammar), one JSON schema is compiled, then a valid instance of it is walked token
by token: at each token the library computes the mask of allowed next tokens and
then consumes the token, as a sampler does. Reported: the compile time and the
median cost of one (mask + consume) per token, over `--repeat` walks, the libraries
alternating within each walk round. A library that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from exokv.model.resolve import load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "role", "active"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "engines", "poetry"],
    "role": "admin",
    "active": True,
}

# A library's walk: (compile seconds, a function walking `tokens` once, returning its seconds)
Walker = tuple[float, Callable[[list[int]], float]]


def llguidance_walker(hf: Any, vocab: int, eos: int) -> Walker:
    import llguidance  # why: optional here, each library is measured only if installed
    import llguidance.hf  # why: as above
    import numpy as np  # why: as above (a dependency of every library measured)

    tic = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    llguidance.LLMatcher(lltok, grammar).compute_bitmask()
    compiled = time.perf_counter() - tic
    mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def walk(tokens: list[int]) -> float:
        matcher = llguidance.LLMatcher(lltok, grammar)
        tic = time.perf_counter()
        for t in tokens:
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            assert matcher.consume_token(t), matcher.get_error()
        return time.perf_counter() - tic

    return compiled, walk


def outlines_walker(hf: Any, vocab: int, eos: int) -> Walker:
    import numpy as np  # why: optional here, as above
    import outlines_core  # why: as above

    tic = time.perf_counter()
    table: dict[str, list[int]] = {}
    for token, i in hf.get_vocab().items():
        if i != eos:
            table.setdefault(hf.convert_tokens_to_string([token]), []).append(i)
    table.pop("", None)
    vocabulary = outlines_core.Vocabulary(eos, table)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocabulary)
    compiled = time.perf_counter() - tic
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def walk(tokens: list[int]) -> float:
        guide = outlines_core.Guide(index)
        tic = time.perf_counter()
        for t in tokens:
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            guide.advance(t)
        return time.perf_counter() - tic

    return compiled, walk


def xgrammar_walker(hf: Any, vocab: int, eos: int) -> Walker:
    import xgrammar  # why: optional here, as above

    tic = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info)
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA))
    compiled = time.perf_counter() - tic
    mask = xgrammar.allocate_token_bitmask(1, vocab)

    def walk(tokens: list[int]) -> float:
        matcher = xgrammar.GrammarMatcher(compiled_grammar)
        tic = time.perf_counter()
        for t in tokens:
            matcher.fill_next_token_bitmask(mask)
            assert matcher.accept_token(t)
        return time.perf_counter() - tic

    return compiled, walk


LIBRARIES = {
    "llguidance": llguidance_walker,
    "outlines-core": outlines_walker,
    "xgrammar": xgrammar_walker,
}


def measure(model: str, repeat: int) -> dict[str, Any]:
    _, wrapper = load_model(model)
    hf = wrapper._tokenizer
    tokens = hf.encode(json.dumps(INSTANCE), add_special_tokens=False)
    vocab = max(len(hf), max(hf.get_vocab().values()) + 1)
    eos = wrapper.eos_token_id
    walkers: dict[str, Walker] = {}
    skipped: dict[str, str] = {}
    for name, make in LIBRARIES.items():
        try:
            walkers[name] = make(hf, vocab, eos)
        except ImportError as err:
            skipped[name] = f"not installed ({err.name})"
        except Exception as err:  # a library that cannot take this tokenizer
            skipped[name] = f"{type(err).__name__}: {err}"[:200]
    times: dict[str, list[float]] = {name: [] for name in walkers}
    for _ in range(repeat):
        for name, (_, walk) in walkers.items():
            times[name].append(walk(tokens) / len(tokens))
    return {
        "model": model,
        "vocab": vocab,
        "tokens": len(tokens),
        "libraries": {
            name: {
                "compile_ms": round(walkers[name][0] * 1000, 1),
                "per_token_us": round(statistics.median(times[name]) * 1e6, 1),
            }
            for name in walkers
        },
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = [measure(m, args.repeat) for m in args.model or ["builtin:tiny"]]
    if args.json:
        print(json.dumps(runs, indent=1))
        return
    for run in runs:
        print(f"{run['model']}: vocab {run['vocab']}, {run['tokens']} tokens walked")
        for name, row in run["libraries"].items():
            print(
                f"  {name:14} compile {row['compile_ms']:8.1f} ms   "
                f"mask+consume {row['per_token_us']:8.1f} us/token"
            )
        for name, why in run["skipped"].items():
            print(f"  {name:14} skipped: {why}")


if __name__ == "__main__":
    main()
