"""`exokv serve -n 2`: a batch's rows draft on two pipeline ranks and reply as without.

Every rank drafts for itself (exokv.rank.batch_drafts): this checks that the two ranks'
drafts, kept counts and trims agree, through the real server. The drafts are the test
hook's (EXOKV_TEST_DRAFTS: one reply's tokens, every third made wrong, for every row),
as builtin:tiny never quotes its prompt.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exokv.config import TEST_DRAFTS
from exokv.core.records import TurnRequest
from exokv.rank.batch import run_batch
from exokv.rank.engine import Engine
from tests.chat_helpers import home_with_models
from tests.serve_helpers import MODEL, serving

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

SYSTEM = "You are the assistant of the drafting batch test; answer briefly."
CLIENTS = 6
MAX_TOKENS = 24


def messages(client: int) -> list[dict[str, str]]:
    line = f"client {client} asks about topic {client * 5 % 7}" + " again" * (client % 3)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": line}]


@pytest.mark.timeout(300)
def test_two_ranks_draft_for_a_batchs_rows_and_reply_as_without(
    tiny, tmp_path: Path, models_dir: Path
) -> None:
    model, tokenizer = tiny
    rows = [
        TurnRequest(f"s{c}", messages(c), max_tokens=MAX_TOKENS, speculate=False)
        for c in range(CLIENTS)
    ]
    engine = Engine(model, tokenizer)
    plain = [o.result for o in run_batch(engine, rows)]
    drafts = tmp_path / "drafts.json"
    drafts.write_text(json.dumps(plain[1].reply_tokens))
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    args = ["--batch", str(CLIENTS), "-n", "2", "--starting-port", "33200"]
    with serving(home, *args, env={TEST_DRAFTS.name: str(drafts)}) as s:
        api = s.client()

        def ask(c: int) -> str:
            done = api.chat.completions.create(
                model=MODEL, messages=messages(c), max_tokens=MAX_TOKENS, temperature=0
            )
            return done.choices[0].message.content

        with ThreadPoolExecutor(CLIENTS) as pool:
            got = list(pool.map(ask, range(CLIENTS)))
        lines = s.wait_log(lambda x: " /v1/" in x and " 200 " in x, count=CLIENTS)
    assert got == [r.reply for r in plain]
    counts = [x.split("drafts=")[1].split()[0] for x in lines if "drafts=" in x]
    assert counts, lines  # rows drafted (the switch is on until a step measures it)
    assert any("batch=" in x and "drafts=" in x for x in lines), lines
