"""Perplexity of a public-domain paragraph on a GGUF model: exokv's loading path vs mlx-lm.

For each model (a catalogue name such as ``smollm2`` or ``gemma3-270m``, or a
``.gguf`` file):

- ``exokv``: the model and tokenizer from ``exokv.model.resolve.load_model`` (fetch,
  conversion and exokv's checked loader), the text encoded by that tokenizer as
  it stands, so the special tokens are whatever the converted tokenizer adds.
- ``mlx-lm``: ``mlx_lm.load`` on the same converted directory, the tokens built by
  hand: the text encoded without special tokens, BOS put in front where the GGUF
  file's own metadata says so (``tokenizer.ggml.add_bos_token``; absent, a
  sentencepiece vocabulary adds it, as in llama.cpp).

Both are teacher-forced over the whole paragraph at once; the perplexity is over
every token after the first. They must agree within 2% (exit code 1 otherwise).
The perplexity without BOS is given beside them, for the models that take one.
``--time-conversion`` converts the model's GGUF once more into a temporary folder
and reports the seconds and the rate per GB (the layers, without the embedding,
give the figure that scales to larger files).

    python benchmarks/gguf_perplexity.py [--model smollm2 --model gemma3-270m]
        [--time-conversion] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from kv_quality import TEXT as PASSAGES  # this folder's own script

# Jane Austen, Pride and Prejudice (1813), the opening: public domain, the last of
# kv_quality's passages.
TEXT = PASSAGES[PASSAGES.index("It is a truth universally acknowledged") :]
AGREE = 0.02
# A 7B Q4_K_M file (Llama 2 7B: 4.08 GB; Mistral 7B: 4.37 GB), for the estimate.
SEVEN_B_GB = 4.1


def gguf_of(name: str) -> Path:
    """The GGUF file behind ``name``: a catalogue model's kept file, or the path itself."""
    from exokv.model.packaged import MODELS
    from exokv.model.wheel_gguf import ensure_gguf

    if name in MODELS:
        return ensure_gguf(MODELS[name])
    return Path(name)


def file_says_bos(gguf: Path) -> int | None:
    """The BOS id when the file asks for one in front of every encoding; else None."""
    from exokv.model.gguf_read import gguf_header

    keys = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.model")
    head = gguf_header(gguf, keys)
    add = head.get("tokenizer.ggml.add_bos_token")
    if add is None:
        add = head.get("tokenizer.ggml.model") == "llama"
    return int(head["tokenizer.ggml.bos_token_id"]) if add else None


def scores(model: Any, tokens: list[int]) -> tuple[float, float]:
    """(perplexity, top-1 agreement) of ``tokens`` under ``model``, teacher-forced."""
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.array(tokens[1:])
    picked = mx.take_along_axis(logprobs[:-1], targets[:, None], axis=-1)[:, 0]
    nll = -picked.mean().item()
    top1 = (mx.argmax(logprobs[:-1], axis=-1) == targets).astype(mx.float32).mean().item()
    return math.exp(nll), top1


def measure(name: str) -> dict[str, Any]:
    from mlx_lm import load as mlx_load

    from exokv.model.resolve import load_model, resolve_model

    model, tokenizer = load_model(name)
    ours = list(tokenizer.encode(TEXT))
    ppl, top1 = scores(model, ours)
    del model

    path = resolve_model(name)
    gguf = gguf_of(name)
    theirs_model, theirs_tok = mlx_load(str(path))
    plain = list(theirs_tok._tokenizer.encode(TEXT, add_special_tokens=False))
    bos = file_says_bos(gguf)
    by_hand = ([bos] if bos is not None else []) + plain
    ref_ppl, ref_top1 = scores(theirs_model, by_hand)
    bare = scores(theirs_model, plain)[0] if bos is not None else None
    return {
        "model": name,
        "gguf": str(gguf),
        "tokens": len(by_hand),
        "same_tokens": ours == by_hand,
        "bos": bos,
        "exokv_ppl": ppl,
        "exokv_top1": top1,
        "mlx_lm_ppl": ref_ppl,
        "mlx_lm_top1": ref_top1,
        "ppl_without_bos": bare,
        "ratio": ppl / ref_ppl,
    }


def time_conversion(name: str) -> dict[str, Any]:
    """One more conversion of the model's GGUF; its seconds, and per GB."""
    from exokv.model.gguf_convert import convert_gguf

    gguf = gguf_of(name)
    marks: list[tuple[float, int, int]] = []
    with tempfile.TemporaryDirectory(prefix="exokv-convert-") as tmp:
        start, cpu = time.monotonic(), time.process_time()
        convert_gguf(gguf, Path(tmp), progress=lambda d, t: marks.append((time.monotonic(), d, t)))
        wall, cpu = time.monotonic() - start, time.process_time() - cpu
    size = gguf.stat().st_size
    embedding = _embedding_bytes(gguf)
    # Time from the end of the embedding's bytes to the end: the layers' rate.
    after = next((m for m in marks if m[1] >= embedding), marks[-1]) if embedding else marks[0]
    layer_bytes = marks[-1][1] - after[1]
    layer_s = marks[-1][0] - after[0]
    # A file mx.load reads whole (only kept types) has no per-tensor timing: the whole rate.
    per_gb = layer_s / (layer_bytes / 1e9) if layer_bytes and layer_s else wall / (size / 1e9)
    return {
        "model": name,
        "file_bytes": size,
        "wall_s": wall,
        "cpu_s": cpu,
        "s_per_gb_whole": wall / (size / 1e9),
        "s_per_gb_layers": per_gb,
        "estimate_7b_q4_k_m_s": per_gb * SEVEN_B_GB,
    }


def _embedding_bytes(gguf: Path) -> int:
    """Bytes of tensor data up to the end of token_embd (read first by exokv's reader)."""
    from gguf import GGUFReader

    done = 0
    for tensor in GGUFReader(str(gguf)).tensors:
        done += int(tensor.n_bytes)
        if tensor.name == "token_embd.weight":
            return done
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="catalogue name or .gguf (repeat)")
    parser.add_argument("--time-conversion", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    names = args.model or ["smollm2", "gemma3-270m"]
    rows = [measure(n) for n in names]
    timings = [time_conversion(n) for n in names] if args.time_conversion else []
    ok = all(abs(r["ratio"] - 1) <= AGREE for r in rows)
    if args.json:
        print(json.dumps({"perplexity": rows, "conversion": timings, "ok": ok}, indent=2))
    else:
        print(f"{'model':<14} {'tokens':>6}  {'exokv ppl':>9}  {'mlx-lm ppl':>10}  "
              f"{'ratio':>6}  {'top-1':>6}  {'no BOS':>7}  same tokens")  # fmt: skip
        for r in rows:
            bare = f"{r['ppl_without_bos']:.1f}" if r["ppl_without_bos"] is not None else "-"
            print(
                f"{r['model']:<14} {r['tokens']:>6}  {r['exokv_ppl']:>9.2f}  "
                f"{r['mlx_lm_ppl']:>10.2f}  {r['ratio']:>6.3f}  {r['exokv_top1']:>6.1%}  "
                f"{bare:>7}  {r['same_tokens']}"
            )
        for t in timings:
            print(
                f"convert {t['model']}: {t['file_bytes'] / 1e6:.0f} MB in {t['wall_s']:.1f}s "
                f"({t['cpu_s']:.1f}s CPU; {t['s_per_gb_whole']:.0f} s/GB whole, "
                f"{t['s_per_gb_layers']:.0f} s/GB for the layers; a 7B Q4_K_M "
                f"({SEVEN_B_GB} GB): about {t['estimate_7b_q4_k_m_s'] / 60:.0f} min)"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
