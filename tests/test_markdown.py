"""Replies rendered as markdown while they stream (exokv.chat.markdown, exokv.chat.render):
the block splitter on chunks cut anywhere, what the screen shows, and raw text with
--plain, NO_COLOR and a non-terminal."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import pytest
from chat_helpers import Terminal, home_with_models
from rich.console import Console

from exokv.chat.markdown import Block, BlockSplitter
from exokv.chat.render import Renderer

REPLY = """# Adding numbers

Here is **a function** that adds *two* numbers:
```python
def add(a: int, b: int) -> int:

    return a + b  # the sum
```
Use it like this:

- `add(1, 2)` gives 3
- `add(2, 2)` gives 4

| a | b | sum |
|---|---|-----|
| 1 | 2 | 3 |

````text
a fence holding ``` and a blank line

inside
````
## Done
That is all.
"""

# What the splitter finishes, in order (the last when the reply ends).
BLOCKS = [
    Block("# Adding numbers\n"),
    Block("Here is **a function** that adds *two* numbers:\n"),
    Block(
        "```python\ndef add(a: int, b: int) -> int:\n\n    return a + b  # the sum\n```\n",
        code="def add(a: int, b: int) -> int:\n\n    return a + b  # the sum",
        lang="python",
    ),
    Block("Use it like this:\n"),
    Block("- `add(1, 2)` gives 3\n- `add(2, 2)` gives 4\n"),
    Block("| a | b | sum |\n|---|---|-----|\n| 1 | 2 | 3 |\n"),
    Block(
        "````text\na fence holding ``` and a blank line\n\ninside\n````\n",
        code="a fence holding ``` and a blank line\n\ninside",
        lang="text",
    ),
    Block("## Done\n"),
    Block("That is all.\n"),
]

UNCLOSED = "Start:\n\n  ~~~js\n  let x = 1;\n\n  x += 2"
UNCLOSED_BLOCKS = [
    Block("Start:\n"),
    Block("  ~~~js\n  let x = 1;\n\n  x += 2", code="let x = 1;\n\nx += 2", lang="js"),
]


def split(chunks: list[str]) -> list[Block]:
    splitter = BlockSplitter()
    blocks: list[Block] = []
    for chunk in chunks:
        blocks += splitter.feed(chunk)
    return blocks + splitter.close()


def test_the_splitter_finds_the_blocks() -> None:
    assert split([REPLY]) == BLOCKS
    assert split([UNCLOSED]) == UNCLOSED_BLOCKS  # a fence never closed ends with the reply
    assert split(["No newline at the end"]) == [Block("No newline at the end")]
    assert split(["\n\n", "  \n"]) == []


@pytest.mark.parametrize("reply,expected", [(REPLY, BLOCKS), (UNCLOSED, UNCLOSED_BLOCKS)])
def test_the_splitter_gives_the_same_blocks_however_the_stream_is_cut(
    reply: str, expected: list[Block]
) -> None:
    for i in range(len(reply) + 1):
        assert split([reply[:i], reply[i:]]) == expected, f"cut at {i}: {reply[:i]!r}"
    assert split(list(reply)) == expected  # a character at a time
    for i in range(1, len(reply)):  # and three pieces
        j = (i * 7) % len(reply)
        a, b = sorted((i, j))
        assert split([reply[:a], reply[a:b], reply[b:]]) == expected


def test_a_block_is_finished_as_soon_as_it_can_be() -> None:
    splitter = BlockSplitter()
    assert splitter.feed("Some text\nmore") == []
    assert splitter.open == "Some text\nmore"
    assert splitter.feed("\n\n") == [Block("Some text\nmore\n")]  # a blank line ends it
    assert splitter.open_block is None
    assert splitter.feed("```py\nx = 1\n\n") == []  # a blank line inside a fence does not
    assert splitter.open_block == Block("```py\nx = 1\n\n", code="x = 1", lang="py")
    done = splitter.feed("```\n")  # the closing fence does
    assert [b.code for b in done] == ["x = 1"]
    assert splitter.feed("# Title\n") == [Block("# Title\n")]  # a heading is one line


# -- what the screen shows -----------------------------------------------------------------

_CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")


def screen(raw: str, cols: int = 200) -> list[list[tuple[str, str]]]:
    """The rows a terminal shows for `raw`, each a list of (character, SGR parameters):
    enough of a VT100 for what rich writes (text, CR, LF, cursor up, erase line, SGR)."""
    rows: list[list[tuple[str, str]]] = [[]]
    r = c = 0
    sgr = ""
    i = 0
    while i < len(raw):
        m = _CSI.match(raw, i)
        if m:
            args, cmd = m.groups()
            if cmd == "m":
                sgr = "" if args in ("", "0") else args
            elif cmd == "A":
                r = max(r - int(args or 1), 0)
            elif cmd == "K":
                rows[r] = [] if args == "2" else rows[r][:c]
            i = m.end()
            continue
        ch = raw[i]
        i += 1
        if ch == "\r":
            c = 0
        elif ch == "\n":
            r, c = r + 1, 0
        elif ch >= " ":
            if c >= cols:
                r, c = r + 1, 0
            while len(rows) <= r:
                rows.append([])
            row = rows[r]
            row.extend([(" ", "")] * (c + 1 - len(row)))
            row[c] = (ch, sgr)
            c += 1
        while len(rows) <= r:
            rows.append([])
    return rows


def lines(rows: list[list[tuple[str, str]]]) -> list[str]:
    return ["".join(ch for ch, _ in row) for row in rows]


def coloured(row: list[tuple[str, str]]) -> bool:
    """A foreground colour on some character that is not a space."""
    return any(ch != " " and re.search(r"(^|;)(3[0-7]|38|9[0-7])(;|$)", s) for ch, s in row)


def stream(renderer: Renderer, reply: str, size: int = 3) -> None:
    renderer.begin_turn()
    for i in range(0, len(reply), size):
        renderer.on_text(reply[i : i + size])
    renderer.end_turn()


def terminal_console(out: io.StringIO) -> Console:
    return Console(file=out, force_terminal=True, width=100, height=40, color_system="256")


def test_a_fence_shows_as_highlighted_code_alone() -> None:
    out = io.StringIO()
    stream(Renderer(terminal_console(out), Console(file=io.StringIO())), REPLY)
    rows = screen(out.getvalue())
    shown = lines(rows)
    start = shown.index("def add(a: int, b: int) -> int:")  # no padding after it
    assert shown[start + 1 : start + 3] == ["", "    return a + b  # the sum"]
    assert coloured(rows[start]) and coloured(rows[start + 2])  # highlighted
    assert not any("```" in line and "holding" not in line for line in shown)
    assert "a fence holding ``` and a blank line" in shown  # the inner backticks are code
    assert any("a function" in line and "**" not in line for line in shown)
    assert any(line.startswith(" • ") and "add(1, 2)" in line for line in shown)
    assert "Done" in "\n".join(shown) and "## Done" not in "\n".join(shown)
    # every finished block once (the open block's drawings are erased)
    assert sum("Use it like this:" in line for line in shown) == 1
    assert sum("That is all." in line for line in shown) == 1


def test_plain_no_color_and_a_non_terminal_print_the_raw_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    stream(Renderer(terminal_console(out), plain=True), REPLY)
    assert out.getvalue() == REPLY
    out = io.StringIO()
    stream(Renderer(Console(file=out, width=100)), REPLY)  # not a terminal
    assert out.getvalue() == REPLY
    monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()
    stream(Renderer(terminal_console(out)), REPLY)
    assert out.getvalue() == REPLY
    monkeypatch.delenv("NO_COLOR")
    out = io.StringIO()
    stream(Renderer(terminal_console(out)), REPLY)
    assert out.getvalue() != REPLY  # rendered


def test_a_reply_stopped_inside_a_fence_still_shows_its_code() -> None:
    out = io.StringIO()
    stream(Renderer(terminal_console(out)), "Here:\n```python\nx = [1,\n     2]")
    shown = lines(screen(out.getvalue()))
    assert "x = [1," in shown and "     2]" in shown and "Here:" in shown
    assert not any("```" in line for line in shown)


POEM = (
    "The sea, a mystic place,\n"
    "A place where the stars shine bright,\n"
    "Where *waves* dance with grace,\n"
    "And the moon gives its light.\n"
)
MIXED = (
    "A list:\n\n- one\n- two\n\n```python\nx = 1\ny = 2\n```\n\nBefore\n\nafter.\n\n"
    "| a | b |\n|---|---|\n| 1 | 2 |\n\n# Head\n"
)


def test_a_poem_keeps_each_line() -> None:
    """A single newline in a paragraph is a line break (strict markdown, and rich, would
    show one run-on paragraph), streamed a few characters at a time and whole."""
    expected = [line.replace("*", "") for line in POEM.splitlines()]
    for size in (3, len(POEM)):
        out = io.StringIO()
        stream(Renderer(terminal_console(out)), POEM, size)
        shown = [line.rstrip() for line in lines(screen(out.getvalue())) if line.strip()]
        assert shown == expected, size
    # a line break in a list item and a quote too; a setext heading stays one title
    out = io.StringIO()
    stream(Renderer(terminal_console(out)), "- one\n  more\n\n> q\n> r\n\nTi\ntle\n===\n")
    shown = [line.rstrip() for line in lines(screen(out.getvalue()))]
    assert " • one" in shown and "   more" in shown
    assert any(line.endswith(" q") for line in shown) and any(line.endswith(" r") for line in shown)
    assert any(line.strip() == "Ti tle" for line in shown)


def test_lists_fences_tables_and_paragraphs_render_as_before() -> None:
    out = io.StringIO()
    stream(Renderer(terminal_console(out)), MIXED)
    shown = [line.rstrip() for line in lines(screen(out.getvalue()))]
    # the screen as rich drew it before line breaks were kept (its own blank rows too)
    assert shown == [
        "A list:",
        "",
        "",
        " • one",
        " • two",
        "",
        "x = 1",
        "y = 2",
        "",
        "Before",
        "",
        "after.",
        "",
        "",
        "",
        " a  b",
        " ────",
        " 1  2",
        "",
        "",
        " " * 48 + "Head",
        "",
        "",
    ]


# -- in a pty ------------------------------------------------------------------------------


def _reply_on_screen(term: Terminal, line: str) -> list[list[tuple[str, str]]]:
    """The screen rows between the echo of `line` and the status line after it."""
    term.type(line + "\r")
    term.expect(r"\d+ prompt · \d+ cached")
    term.expect(r"› ")
    raw = term.raw.decode("utf-8", "replace")
    status = raw.rfind(" prompt · ")
    end = raw.rfind("\n", 0, status) + 1
    start = raw.rfind(line, 0, end) + len(line)
    start = raw.index("\n", start) + 1
    return screen(raw[start:end])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("plain", [False, True])
def test_the_repl_renders_a_fence_and_plain_prints_it_raw(
    tmp_path: Path, models_dir: Path, plain: bool
) -> None:
    """A real REPL on a pseudo-terminal, builtin:tiny streaming; EXOKV_TEST_SHOWN_REPLY
    puts REPLY in place of the model's words (at the model's pace), so the screen has a
    known fenced code block to show."""
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    shown_file = tmp_path / "reply.md"
    shown_file.write_text(REPLY)
    env = {k: v for k, v in os.environ.items() if k not in ("EXOKV_DEBUG", "NO_COLOR")}
    env.update(EXOKV_HOME=str(home), EXOKV_TEST_SHOWN_REPLY=str(shown_file))
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "--max-tokens", "300"]
    term = Terminal(cmd + (["--plain"] if plain else []), env)
    try:
        term.expect(r"› ")
        rows = _reply_on_screen(term, "Write a Python function that adds two numbers.")
        term.type("\x04")
        term.expect(r"bye")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    shown = lines(rows)
    if plain:
        assert "\n".join(shown).rstrip("\n") == REPLY.rstrip("\n")
        assert not any(coloured(row) for row in rows)
        return
    start = shown.index("def add(a: int, b: int) -> int:")
    assert shown[start + 2] == "    return a + b  # the sum"
    assert coloured(rows[start]) and coloured(rows[start + 2])
    assert not any(line.strip().startswith("```") for line in shown)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_repl_keeps_a_poems_line_breaks(tmp_path: Path, models_dir: Path) -> None:
    """The REPL on a pseudo-terminal shows a poem-shaped reply one line per line, and a
    list and a fence after it as before."""
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    shown_file = tmp_path / "reply.md"
    shown_file.write_text(POEM + "\n- one\n- two\n\n```python\nx = 1\n```\n")
    env = {k: v for k, v in os.environ.items() if k not in ("EXOKV_DEBUG", "NO_COLOR")}
    env.update(EXOKV_HOME=str(home), EXOKV_TEST_SHOWN_REPLY=str(shown_file))
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "--max-tokens", "300"]
    term = Terminal(cmd, env)
    try:
        term.expect(r"› ")
        rows = _reply_on_screen(term, "Write a poem about the sea.")
        term.type("\x04")
        term.expect(r"bye")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    shown = [line.rstrip() for line in lines(rows)]
    poem = [line.replace("*", "") for line in POEM.splitlines()]
    start = shown.index(poem[0])
    assert shown[start : start + 4] == poem
    assert shown[start + 4 : start + 10] == ["", "", " • one", " • two", "", "x = 1"]


def test_each_token_redraws_the_open_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn on every token, a reply ten times as long writes about ten times as much
    (a whole reply redrawn on every token would write about a hundred times as much)."""
    import exokv.chat.markdown as markdown

    monkeypatch.setattr(markdown, "REFRESH_S", 0.0)
    monkeypatch.setattr(markdown, "DRAW_SHARE", 1e9)
    written = []
    for copies in (1, 10):
        out = io.StringIO()
        stream(Renderer(terminal_console(out)), "\n".join([REPLY] * copies))
        written.append(len(out.getvalue()))
    assert 8 * written[0] < written[1] < 13 * written[0], written
