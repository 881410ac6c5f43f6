"""Is a batched greedy decode the same as one at a time? (For batching in exokv serve.)

    python benchmarks/batch_identity.py --model builtin:base --prompts 12 --tokens 48

Decodes the same chat prompts with mlx-lm's `batch_generate` (left-padded batch
caches, as mlx_lm.server batches) and one at a time with `generate_step`, greedy,
and counts the prompts whose tokens are identical. exokv's promise that a reply at
temperature 0 does not depend on the cache or the layout would have to hold for a
batch too (docs/serve-batching.md).
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.sample_utils import make_sampler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="builtin:base")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    from exokv.model.resolve import resolve_model

    model, tokenizer = load(str(resolve_model(args.model)))
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"message {i} about topic {i * 7 % 11} " * (1 + i % 3)}],
            add_generation_prompt=True,
        )
        for i in range(args.prompts)
    ]
    batched = batch_generate(
        model, tokenizer, prompts, max_tokens=args.tokens, return_token_ids=True
    ).token_ids
    same = 0
    for prompt, together in zip(prompts, batched, strict=True):
        alone = []
        steps = generate_step(
            mx.array(prompt), model, max_tokens=args.tokens, sampler=make_sampler(0.0)
        )
        for token, _ in steps:
            if int(token) in tokenizer.eos_token_ids:
                break
            alone.append(int(token))
        same += alone == together
    print(f"{args.model}: {same}/{len(prompts)} prompts decode the same batched and alone")


if __name__ == "__main__":
    main()
