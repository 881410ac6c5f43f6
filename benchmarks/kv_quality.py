"""Quality of a quantized KV cache on a trained model (SmolLM2-135M-Instruct).

Teacher-forced over about 1,000 tokens of public-domain English (TEXT below: the
Gettysburg Address, the opening of the Declaration of Independence, of A Tale of
Two Cities and of Pride and Prejudice), fed as the chat feeds a conversation: in
segments ("turns"), each attending to everything before it. For `--kv-bits 8` and
`4` (each group size that divides the head dimension, 64 and 32), it reports the
next-token agreement with a full-precision cache (argmax of the logits at every
position) and the perplexity of the text against the full-precision one, for:

- `exokv`: exokv's stored-and-fetched cache, as the chat runs a turn: the prefix
  cache of an `Engine` built with `EngineOptions(kv_bits=..., kv_group_size=...)`
  fetches the longest stored prefix (rebuilt from the quantized slices it stores),
  the model runs the segment on it, and the segment is inserted back.
- `mlx-lm`: mlx-lm's own `QuantizedKVCache` (what exokv's caches are made of),
  one cache carried through the same segments, never stored or fetched.

The full-precision reference is mlx-lm's `KVCache` carried through the same
segments, so chunking is the same everywhere and only the cache's precision
differs. The weights are the model's own 4-bit ones in every run. A figure, not a
threshold; the results are in benchmarks/README.md.

    python benchmarks/kv_quality.py [--segment 100] [--bits 8,4] [--groups 64,32] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from exokv.model.resolve import load_model
from exokv.model.smollm2 import ensure_smollm2
from exokv.rank.engine import Engine, EngineOptions

# Public domain: Lincoln (1863), the Declaration of Independence (1776), Dickens
# (1859), Austen (1813). Well known, so a trained model predicts it better than
# unseen prose: the figures are the change a quantized cache makes, not a benchmark
# of the model.
TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new \
nation, conceived in Liberty, and dedicated to the proposition that all men are \
created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation \
so conceived and so dedicated, can long endure. We are met on a great battle-field of \
that war. We have come to dedicate a portion of that field, as a final resting place \
for those who here gave their lives that that nation might live. It is altogether \
fitting and proper that we should do this.

But, in a larger sense, we can not dedicate, we can not consecrate, we can not \
hallow this ground. The brave men, living and dead, who struggled here, have \
consecrated it, far above our poor power to add or detract. The world will little \
note, nor long remember what we say here, but it can never forget what they did \
here. It is for us the living, rather, to be dedicated here to the unfinished work \
which they who fought here have thus far so nobly advanced. It is rather for us to be \
here dedicated to the great task remaining before us, that from these honored dead we \
take increased devotion to that cause for which they gave the last full measure of \
devotion, that we here highly resolve that these dead shall not have died in vain, \
that this nation, under God, shall have a new birth of freedom, and that government \
of the people, by the people, for the people, shall not perish from the earth.

When in the Course of human events, it becomes necessary for one people to dissolve \
the political bands which have connected them with another, and to assume among the \
powers of the earth, the separate and equal station to which the Laws of Nature and \
of Nature's God entitle them, a decent respect to the opinions of mankind requires \
that they should declare the causes which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they \
are endowed by their Creator with certain unalienable Rights, that among these are \
Life, Liberty and the pursuit of Happiness. That to secure these rights, Governments \
are instituted among Men, deriving their just powers from the consent of the \
governed. That whenever any Form of Government becomes destructive of these ends, it \
is the Right of the People to alter or to abolish it, and to institute new \
Government, laying its foundation on such principles and organizing its powers in \
such form, as to them shall seem most likely to effect their Safety and Happiness. \
Prudence, indeed, will dictate that Governments long established should not be \
changed for light and transient causes; and accordingly all experience hath shewn, \
that mankind are more disposed to suffer, while evils are sufferable, than to right \
themselves by abolishing the forms to which they are accustomed. But when a long \
train of abuses and usurpations, pursuing invariably the same Object evinces a design \
to reduce them under absolute Despotism, it is their right, it is their duty, to \
throw off such Government, and to provide new Guards for their future security.

It was the best of times, it was the worst of times, it was the age of wisdom, it was \
the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, \
it was the season of Light, it was the season of Darkness, it was the spring of hope, \
it was the winter of despair, we had everything before us, we had nothing before us, \
we were all going direct to Heaven, we were all going direct the other way. In short, \
the period was so far like the present period, that some of its noisiest authorities \
insisted on its being received, for good or for evil, in the superlative degree of \
comparison only.

It is a truth universally acknowledged, that a single man in possession of a good \
fortune, must be in want of a wife.

However little known the feelings or views of such a man may be on his first \
entering a neighbourhood, this truth is so well fixed in the minds of the surrounding \
families, that he is considered the rightful property of some one or other of their \
daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield \
Park is let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all \
about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.
"""


def text_tokens(tokenizer: Any, limit: int) -> list[int]:
    return list(tokenizer.encode(TEXT))[:limit]


def segments(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def run_carried(
    model: Any, make_cache: Callable[[], list[Any]], tokens: list[int], size: int
) -> mx.array:
    """Logits at every position, one cache carried through the segments."""
    cache = make_cache()
    out = []
    for a, b in segments(len(tokens), size):
        logits = model(mx.array(tokens[a:b])[None], cache=cache)[0].astype(mx.float32)
        mx.eval(logits)
        out.append(logits)
    return mx.concatenate(out)


def run_exokv(engine: Engine, tokens: list[int], size: int) -> mx.array:
    """Logits at every position, each segment run on what exokv's prefix cache fetched
    (the whole text before it, stored quantized by the previous segments), then stored."""
    pc = engine.cache
    out = []
    for a, b in segments(len(tokens), size):
        prefix = tokens[:b]
        hit = pc.fetch(prefix, expect=b, lend=pc.exact_anywhere)
        try:
            if a and hit.length != a:
                raise RuntimeError(f"fetched {hit.length} tokens, expected {a}")
            logits = engine.model(mx.array(prefix[hit.length :])[None], cache=hit.cache)[0]
            logits = logits.astype(mx.float32)
            mx.eval(logits)
            out.append(logits)
            pc.insert(prefix, hit.cache, length=b)
        finally:
            pc.release(hit)
    return mx.concatenate(out)


def progress(what: str, start: float) -> None:
    print(f"  {what}: {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)


def log_probs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(full: mx.array, other: mx.array, tokens: list[int]) -> dict[str, float]:
    """Agreement of the next-token argmax with full precision, perplexity, mean KL."""
    targets = mx.array(tokens[1:])
    lp, lq = log_probs(full[:-1]), log_probs(other[:-1])
    nll = -mx.take_along_axis(lq, targets[:, None], axis=-1).mean().item()
    agree = (mx.argmax(full[:-1], axis=-1) == mx.argmax(other[:-1], axis=-1)).mean().item()
    kl = (mx.exp(lp) * (lp - lq)).sum(axis=-1).mean().item()
    return {"agreement": agree, "perplexity": math.exp(nll), "kl": kl}


def quantized_cache(model: Any, group: int, bits: int) -> Callable[[], list[Any]]:
    def make() -> list[Any]:
        cache = make_prompt_cache(model)
        return [QuantizedKVCache(group, bits) if type(c) is KVCache else c for c in cache]

    return make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1000, help="tokens of TEXT to use")
    ap.add_argument("--segment", type=int, default=100, help="tokens per turn")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--groups", default="64,32")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    path = ensure_smollm2()
    model, tokenizer = load_model(str(path))
    tokens = text_tokens(tokenizer, args.tokens)
    start = time.perf_counter()
    full = run_carried(model, lambda: make_prompt_cache(model), tokens, args.segment)
    progress("full precision", start)
    reference = compare(full, full, tokens)
    rows: list[dict[str, Any]] = []
    for bits in (int(b) for b in args.bits.split(",")):
        for group in (int(g) for g in args.groups.split(",")):
            options = EngineOptions(kv_bits=bits, kv_group_size=group)
            engine = Engine(model, tokenizer, options=options)
            ours = run_exokv(engine, tokens, args.segment)
            progress(f"exokv {bits}-bit group {group}", start)
            theirs = run_carried(model, quantized_cache(model, group, bits), tokens, args.segment)
            progress(f"mlx-lm {bits}-bit group {group}", start)
            same = mx.abs(ours - theirs).max().item()
            for name, logits in (("exokv", ours), ("mlx-lm", theirs)):
                row = {"bits": bits, "group": group, "cache": name, **compare(full, logits, tokens)}
                row["ppl_change"] = row["perplexity"] / reference["perplexity"] - 1
                row["max_logit_diff_exokv_vs_mlx_lm"] = same
                rows.append(row)
    doc = {
        "model": str(path),
        "tokens": len(tokens),
        "segment": args.segment,
        "full_precision_perplexity": reference["perplexity"],
        "rows": rows,
        "seconds": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(
        f"{len(tokens)} tokens in segments of {args.segment}; "
        f"full-precision perplexity {reference['perplexity']:.3f}"
    )
    print(f"{'bits':>4} {'group':>5} {'cache':>7} {'agree':>7} {'ppl':>8} {'change':>8} {'KL':>8}")
    for r in rows:
        print(
            f"{r['bits']:>4} {r['group']:>5} {r['cache']:>7} {r['agreement']:>7.2%} "
            f"{r['perplexity']:>8.3f} {r['ppl_change']:>+8.2%} {r['kl']:>8.5f}"
        )
    worst = max(r["max_logit_diff_exokv_vs_mlx_lm"] for r in rows)
    print(f"largest |logit| difference, exokv's stored-and-fetched vs mlx-lm's carried: {worst:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
