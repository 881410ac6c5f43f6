"""A GGUF file's tokenizer and chat template as Hugging Face tokenizer files.

Through transformers' GGUF tokenizer builders (``convert_gguf_tokenizer``): the
parts that need no torch. The chat template is the metadata's, as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tokenizers import pre_tokenizers, processors

from exokv.errors import ExokvError
from exokv.model import builtin
from exokv.model.gguf_read import text, value_of

# llama.cpp pre-tokenizers that isolate each digit before GPT-2's split (SmolLM's).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def write_tokenizer(arch: str, meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) from the metadata."""
    quiet_transformers()
    # deferred: transformers (1.5 s) only while converting; `exokv models` imports this
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

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
        # llama.cpp splits digits one by one for these; transformers' table has no entry.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )

    def token(field: str) -> str | None:
        named = _special(spec, field)
        return named[0] if named else None

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # As llama.cpp does: a sentencepiece vocabulary that does not say adds BOS.
        add_bos = spec.get("tokenizer_type") == "llama"
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    bos = _special(spec, "bos_token_id") if value_of(add_bos) else None
    eos = _special(spec, "eos_token_id") if add_eos is not None and value_of(add_eos) else None
    _add_specials(backend, bos, eos)
    backend.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unk_token_id"),
        "pad_token": token("pad_token_id"),
        "add_bos_token": bos is not None,
        "add_eos_token": eos is not None,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = text(template)
    builtin.write_json(out / "tokenizer_config.json", tokenizer_config)


def _special(spec: dict[str, Any], field: str) -> tuple[str, int] | None:
    """(token, id) of the metadata's token ``field`` (bos_token_id, ...), None if it names none."""
    index, tokens = spec.get(field), spec["tokens"]
    return (tokens[index], index) if isinstance(index, int) and 0 <= index < len(tokens) else None


def _add_specials(backend: Any, bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> None:
    """BOS before and EOS after every encoding, as the file's add_bos/add_eos_token say.

    In tokenizer.json itself: with add_bos_token in tokenizer_config.json alone,
    transformers 5 loads the saved post-processor and adds nothing. transformers'
    builders (sentencepiece and GPT-2 style alike) set an empty TemplateProcessing,
    which is replaced; any other post-processor is kept ahead of ours.
    """
    if bos is None and eos is None:
        return  # the builder's post-processor as it is: such files tokenize as before

    def sequence(name: str, type_id: int) -> str:
        head = f"{bos[0]}:{type_id} " if bos else ""
        tail = f" {eos[0]}:{type_id}" if eos else ""
        return f"{head}${name}:{type_id}{tail}"

    single = sequence("A", 0)
    pair = f"{single} {sequence('B', 1)}"
    specials = [t for t in (bos, eos) if t is not None]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    existing = backend.post_processor
    if existing is None or isinstance(existing, processors.TemplateProcessing):
        backend.post_processor = template
    else:
        backend.post_processor = processors.Sequence([existing, template])


def quiet_transformers() -> None:
    """No advice about PyTorch on import: exokv uses only transformers' tokenizer parts."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
