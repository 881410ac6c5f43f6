"""A GGUF file's tokenizer and chat template as Hugging Face tokenizer files.

Through transformers' GGUF tokenizer builders (``convert_gguf_tokenizer``): the
parts that need no torch. The chat template is the metadata's, as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exokv.errors import ExokvError
from exokv.model.gguf_read import text, value_of

# llama.cpp pre-tokenizers that isolate each digit before GPT-2's split (SmolLM's).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def write_tokenizer(arch: str, meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) from the metadata."""
    quiet_transformers()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    from exokv.model import builtin

    fields = GGUF_TOKENIZER_MAPPING["tokenizer"]
    spec = {
        name: value_of(meta[f"tokenizer.{key}"])
        for key, name in fields.items()
        if f"tokenizer.{key}" in meta
    }
    if "tokens" not in spec:
        raise ExokvError("the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    try:
        backend, _ = convert_gguf_tokenizer(arch, spec)
    except ValueError as e:
        raise ExokvError(f"cannot build the GGUF file's tokenizer: {e}") from e
    if spec.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        from tokenizers import pre_tokenizers

        # llama.cpp splits digits one by one for these; transformers' table has no entry.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    backend.save(str(out / "tokenizer.json"))
    tokens = spec["tokens"]

    def token(field: str) -> str | None:
        index = spec.get(field)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # As llama.cpp does: a sentencepiece vocabulary that does not say adds BOS.
        add_bos = spec.get("tokenizer_type") == "llama"
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unk_token_id"),
        "pad_token": token("pad_token_id"),
        "add_bos_token": bool(value_of(add_bos)),
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = text(template)
    builtin.write_json(out / "tokenizer_config.json", tokenizer_config)


def quiet_transformers() -> None:
    """No advice about PyTorch on import: exokv uses only transformers' tokenizer parts."""
    import os

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
