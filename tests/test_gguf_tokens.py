"""A GGUF file's own tokens: BOS/EOS added as its metadata says, every end-of-turn token stops.

The file is a tiny llama written with the gguf package, with a sentencepiece
(``llama``-type) vocabulary as llama.cpp's converter stores one: tokens, scores
and token types, no merges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

UNKNOWN, NORMAL, CONTROL = 2, 1, 3
SPECIAL = ["<unk>", "<s>", "</s>", "<end_of_turn>", "<eom>"]
PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "he", "ll", "lo", "\u2581w"]
BOS, EOS, EOT, EOM = 1, 2, 3, 4
HIDDEN, FFN, HEADS = 16, 32, 2


# Two chat templates: one writes BOS itself (as Llama's and Gemma's do), one does not.
WRITES_BOS = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<end_of_turn>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
NO_BOS = WRITES_BOS.removeprefix("{{ bos_token }}")


# A GPT-2 style (byte-level) vocabulary: "\u0120" is a space in its byte alphabet.
BYTE_PIECES = ["\u0120", "h", "e", "l", "o", "w", "r", "d", "he", "ll"]


def _write(
    path: Path,
    add_bos: bool | None,
    add_eos: bool = False,
    template: str = NO_BOS,
    model: str = "llama",
) -> Path:
    import gguf

    pieces = PIECES if model == "llama" else BYTE_PIECES
    tokens = SPECIAL + pieces
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    if model == "llama":
        writer.add_token_scores([0.0] * len(SPECIAL) + [-float(i) for i in range(len(pieces))])
    else:
        writer.add_token_merges(["h e", "l l"])
    types = [UNKNOWN] + [CONTROL] * (len(SPECIAL) - 1) + [NORMAL] * len(pieces)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_eot_token_id(EOT)
    writer.add_eom_token_id(EOM)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for name, shape in (
        ("attn_norm", (HIDDEN,)),
        ("ffn_norm", (HIDDEN,)),
        ("attn_q", (HIDDEN, HIDDEN)),
        ("attn_k", (HIDDEN, HIDDEN)),
        ("attn_v", (HIDDEN, HIDDEN)),
        ("attn_output", (HIDDEN, HIDDEN)),
        ("ffn_gate", (FFN, HIDDEN)),
        ("ffn_up", (FFN, HIDDEN)),
        ("ffn_down", (HIDDEN, FFN)),
    ):
        value = np.ones(shape, np.float32) if len(shape) == 1 else weight(*shape)
        writer.add_tensor(f"blk.0.{name}.weight", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **flags: Any) -> Any:
    from exokv.model.resolve import load_model

    monkeypatch.setenv("EXOKV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EXOKV_MODELS", str(tmp_path / "models"))
    _, tokenizer = load_model(str(_write(tmp_path / "tiny.gguf", **flags)))
    return tokenizer


@pytest.mark.parametrize("add_bos", [True, None])
def test_bos_is_added_once_when_the_file_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, add_bos: bool | None
) -> None:
    # None: the file does not say, and llama.cpp adds BOS to a sentencepiece vocabulary.
    tokenizer = _tokenizer(tmp_path, monkeypatch, add_bos=add_bos)
    ids = list(tokenizer.encode("hello world"))
    assert ids[0] == BOS and ids.count(BOS) == 1, ids
    assert EOS not in ids, ids


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_bos_is_added_once_to_either_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    tokenizer = _tokenizer(tmp_path, monkeypatch, add_bos=True, model=model)
    ids = list(tokenizer.encode("hello world"))
    assert ids[0] == BOS and ids.count(BOS) == 1, ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_no_bos_when_the_file_says_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    tokenizer = _tokenizer(tmp_path, monkeypatch, add_bos=False, model=model)
    ids = list(tokenizer.encode("hello world"))
    assert BOS not in ids and ids, ids


def test_eos_is_appended_when_the_file_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = _tokenizer(tmp_path, monkeypatch, add_bos=True, add_eos=True)
    ids = list(tokenizer.encode("hello world"))
    assert ids[0] == BOS and ids[-1] == EOS and ids.count(EOS) == 1, ids


def test_every_end_of_turn_token_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = _tokenizer(tmp_path, monkeypatch, add_bos=True)
    assert {EOS, EOT, EOM} <= set(tokenizer.eos_token_ids), tokenizer.eos_token_ids
