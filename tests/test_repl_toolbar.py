"""What Enter will cost: while a draft is typed, the bottom toolbar shows its tokens, how
many the tree holds already and the wait to the first token at the measured prefill
speed. In process, with prompt-toolkit's pipe input and a VT100 output to a buffer."""

from __future__ import annotations

import io
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from chat_helpers import ANSI
from prompt_toolkit.application import create_app_session
from prompt_toolkit.data_structures import Size
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output.vt100 import Vt100_Output
from rich.console import Console
from test_repl import FakeClient, Opts

from exokv.chat.conversation import ChatController, TurnSettings
from exokv.chat.render import Renderer, status_line
from exokv.chat.repl import run_repl
from exokv.chat.typeahead import PrefillSpeed, toolbar_text
from exokv.client import stopwatch
from exokv.core.records import DraftCost, TurnResult

pytestmark = pytest.mark.timeout(60)


class DraftingClient(FakeClient):
    """Says of every draft: 1,234 tokens, 1,200 of them cached; prefills 2,000 tok/s: its
    first text comes 0.5 s after the request on `clock`, the front end's stopwatch (the
    one TTFT, exokv.client.stopwatch), for a prompt of which 1,000 tokens prefilled."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.drafts: list[str] = []
        self.clock = clock

    def draft(self, session, messages, text, wait=False) -> None:
        self.drafts.append(text)

    def draft_cost(self, session: str) -> DraftCost | None:
        return DraftCost(session, 1234, 1200) if self.drafts and self.drafts[-1] else None

    def turn(self, request, on_text=None, on_progress=None) -> TurnResult:
        self.clock[0] += 0.5  # the prefill, before the first text
        result = super().turn(request, on_text, on_progress)
        return replace(result, prompt_tokens=1040, cached_tokens=40, prefilled_tokens=1000)


def test_the_toolbar_shows_the_drafts_tokens_cached_and_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    clock = [100.0]
    monkeypatch.setattr(stopwatch, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    client = DraftingClient(clock)
    chat = ChatController(client, TurnSettings(), "main")
    screen = io.StringIO()
    output = Vt100_Output(screen, lambda: Size(rows=30, columns=120), term="xterm")
    out = io.StringIO()
    renderer = Renderer(Console(file=out, width=120), Console(file=out, width=120))
    paste = "a pasted paragraph, long enough to be sent at once as a draft"
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=output):

        def keys() -> None:
            pipe.send_text("first\r")
            time.sleep(1.0)
            # The terminal's answer to the prompt's cursor position request: a bottom
            # toolbar is drawn once the height below the prompt is known.
            pipe.send_text("\x1b[5;1R")
            pipe.send_bytes(("\x1b[200~" + paste + "\x1b[201~").encode())
            time.sleep(2.0)  # the toolbar is redrawn every half second
            pipe.send_text("\r\x04")

        typist = threading.Thread(target=keys, daemon=True)
        typist.start()
        code = run_repl(chat, client, Opts(), input=pipe, output=output, renderer=renderer)
        typist.join()
    assert code == 0
    assert [r.messages[-1]["content"] for r in client.requests] == ["first", paste]
    drawn = ANSI.sub("", screen.getvalue())
    # 34 tokens left at 2,000 tok/s (1,000 prefilled in 0.5 s): 17 ms
    assert "draft 1,234 tokens · 1,200 cached · Enter ≈ 17 ms to the first token" in drawn


def test_toolbar_text_and_the_measured_speed() -> None:
    speed = PrefillSpeed()
    speed.turn(10, 0.1)  # too few tokens to say anything
    assert speed.tps is None and toolbar_text(DraftCost("s", 500, 100), speed.tps) == (
        "draft 500 tokens · 100 cached"
    )
    speed.turn(4000, 2.0)
    assert toolbar_text(DraftCost("s", 10_500, 500), speed.tps) == (
        "draft 10,500 tokens · 500 cached · Enter ≈ 5.0 s to the first token"
    )
    assert toolbar_text(None, speed.tps) == "" and toolbar_text(DraftCost("s", 0, 0), 1.0) == ""


def test_the_status_line_says_how_much_typing_ahead_prefilled() -> None:
    result = TurnResult("s", "x", 2000, 1990, 10, 4, 0.1, 40.0, 0.0, 1)
    result.typed_ahead_tokens = 1900
    assert "1,900 typed ahead (95% of the prompt)" in status_line(result)
