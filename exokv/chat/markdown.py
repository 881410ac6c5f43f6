"""Replies rendered as markdown while they stream: finished blocks once, the open one live.

The design, and why:

- `BlockSplitter` (pure) cuts the streamed text into markdown blocks. A block is finished
  at a blank line outside a fence, at a closing fence, and where a fence or an ATX
  heading starts (both interrupt a paragraph, so what came before them is finished too).
  A heading is finished as soon as its line is. Nothing before a finished block can
  change how it renders, so it is rendered once and printed for good: the terminal
  scrolls it like any output, and its cost does not grow with the reply.
- The open block (the paragraph, list, table or fence being written) is a rich `Live`
  region holding that block alone, rendered as markdown, so emphasis and code colours
  show as soon as they can. It is redrawn at most every `REFRESH_S` (never more than
  once per token) and in at most `DRAW_SHARE` of the time, each time in one write; a
  region that is only the open block is a few lines, so the redraw is small and does
  not flicker the way redrawing a whole reply would. A block taller than the terminal
  shows its last rows (`_Tail`): a live region taller than the screen cannot be redrawn
  in place. When a block finishes, it is printed above the region and the region shows
  the next open block, in the same write.
- Streaming the open block as plain text and replacing it when it closes would need
  the number of screen rows the raw text took (wrapping, wide characters, a resize)
  to erase it; rich's Live already keeps that account.
- A code fence is printed as the highlighted code alone: no backticks, no box, no line
  numbers, no padding (rich's own `Syntax` pads lines to the width with its background
  colour, which copying a block from the screen would pick up as trailing spaces), and
  with the terminal's soft wrap rather than rich's, so a long line copies as one line.
- A single newline inside a paragraph is a line break (`keep_line_breaks`), as chat
  front ends show a model's verse; strict markdown, and rich, would join the lines.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.markdown import CodeBlock, Markdown
from rich.segment import Segment
from rich.syntax import Syntax
from rich.text import Text

if TYPE_CHECKING:  # rich's parser's tokens; markdown-it comes with rich
    from markdown_it.token import Token

# A fence opens with 3+ backticks or tildes, indented 0-3 spaces (CommonMark); a backtick
# fence's info string holds no backtick.
_FENCE = re.compile(r"^( {0,3})(`{3,}(?=[^`]*$)|~{3,})(.*)$")
_HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]|$)")
CODE_THEME = "monokai"
REFRESH_S = 1 / 30  # the open block is redrawn at most this often
# ...and at most this share of the time: a long open block costs more to draw, so it is
# drawn less often rather than slowing the reply (and Ctrl-C) down.
DRAW_SHARE = 0.2


@dataclass(frozen=True)
class Block:
    """One finished block: its markdown source; for a fence, its code and language."""

    source: str
    code: str | None = None  # a fenced code block's lines (None: not a fence)
    lang: str = ""


@dataclass
class _Fence:
    char: str
    length: int
    indent: int
    lang: str


class BlockSplitter:
    """Cuts streamed reply text into finished markdown blocks; `open` is the rest."""

    def __init__(self) -> None:
        self._lines: list[str] = []  # the open block's whole lines, with their newlines
        self._partial = ""  # the line being written
        self._fence: _Fence | None = None

    @property
    def open(self) -> str:
        """The open block's text so far (its last line maybe unfinished)."""
        return "".join(self._lines) + self._partial

    @property
    def open_block(self) -> Block | None:
        """The open block as it would render if the reply ended now; None: nothing open."""
        if not self._lines and not self._partial.strip():
            return None
        return self._block(self._lines + ([self._partial] if self._partial else []))

    def feed(self, text: str) -> list[Block]:
        """Take the next piece of the reply; the blocks it finished, in order."""
        done: list[Block] = []
        self._partial += text
        while "\n" in self._partial:
            line, _, self._partial = self._partial.partition("\n")
            self._line(line + "\n", done)
        return done

    def close(self) -> list[Block]:
        """The reply ended: what is open is finished (a fence never closed included)."""
        done: list[Block] = []
        if self._partial:
            line, self._partial = self._partial, ""
            self._line(line, done)
        self._finish(done)
        self._fence = None
        return done

    def _line(self, line: str, done: list[Block]) -> None:
        body = line.rstrip("\n")
        if self._fence is not None:
            self._lines.append(line)
            if self._closes(body):
                self._finish(done)
            return
        opening = _FENCE.match(body)
        if opening:
            self._finish(done)  # a fence interrupts a paragraph
            indent, marks, info = opening.groups()
            lang = info.strip().split(" ")[0] if info.strip() else ""
            self._fence = _Fence(marks[0], len(marks), len(indent), lang)
            self._lines.append(line)
        elif not body.strip():
            self._finish(done)
        elif _HEADING.match(body):
            self._finish(done)
            self._lines.append(line)
            self._finish(done)
        else:
            self._lines.append(line)

    def _closes(self, body: str) -> bool:
        fence = self._fence
        assert fence is not None
        stripped = body.strip()
        indent = len(body) - len(body.lstrip(" "))
        return (
            indent <= 3
            and len(stripped) >= fence.length
            and set(stripped) == {fence.char}
            and len(self._lines) > 1  # not the opening line itself
        )

    def _finish(self, done: list[Block]) -> None:
        if self._lines:
            done.append(self._block(self._lines))
        self._lines = []
        self._fence = None

    def _block(self, lines: list[str]) -> Block:
        source = "".join(lines)
        fence = self._fence
        if fence is None:
            return Block(source)
        body = lines[1:]
        if len(body) > 0 and self._closes(body[-1].rstrip("\n")):
            body = body[:-1]
        # Content lines lose up to the opening fence's indentation (CommonMark).
        code = "".join(_dedent(line, fence.indent) for line in body)
        return Block(source, code=code.rstrip("\n"), lang=fence.lang)


def _dedent(line: str, width: int) -> str:
    strip = len(line) - len(line.lstrip(" "))
    return line[min(strip, width) :]


def highlighted(code: str, lang: str) -> Text:
    """The code with its colours and nothing else (no padding, no background)."""
    syntax = Syntax(code, lang or "text", theme=CODE_THEME, background_color="default")
    text = syntax.highlight(code)
    text.rstrip()
    return text


class _Code(CodeBlock):
    """A code block inside a markdown block (an indented one): highlighted, unpadded."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield highlighted(str(self.text).rstrip(), self.lexer_name)


class _Markdown(Markdown):
    """rich's Markdown, keeping a paragraph's single line breaks (see `keep_line_breaks`)."""

    elements = {**Markdown.elements, "fence": _Code, "code_block": _Code}

    def __init__(self, markup: str, **options: Any) -> None:
        super().__init__(markup, **options)
        keep_line_breaks(self.parsed)


def keep_line_breaks(tokens: list[Token]) -> list[Token]:
    """A single newline inside a paragraph becomes a line break, as chat front ends show
    a model's verse and line-per-line answers (markdown-it's `breaks` option). That option
    only changes markdown-it's HTML output: its parser still gives a `softbreak`, which
    rich shows as a space, so the token itself becomes a `hardbreak` here. Only paragraph
    text (in a list item or a quote too): a setext heading's lines stay one title, and
    fences, tables and ATX headings hold no soft breaks."""
    for before, token in zip(tokens, tokens[1:], strict=False):
        if token.type == "inline" and before.type == "paragraph_open":
            for child in token.children or []:
                if child.type == "softbreak":
                    child.type = "hardbreak"
    return tokens


def rendered(block: Block) -> RenderableType:
    """How a block shows: a fence as its highlighted code, the rest as rich's markdown."""
    if block.code is not None:
        return highlighted(block.code, block.lang)
    # justify "default": no spaces padding lines to the width (they would be copied too).
    return _Markdown(block.source, code_theme=CODE_THEME, justify="default", hyperlinks=False)


class _Tail:
    """The last `rows` rows of a renderable: a live region must fit on the screen."""

    def __init__(self, renderable: RenderableType, rows: int) -> None:
        self.renderable = renderable
        self.rows = rows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.renderable, options, pad=False)
        for line in lines[-self.rows :]:
            yield from line
            yield Segment.line()


class _Open:
    """What the live region shows: whatever `view` is when rich draws it."""

    def __init__(self) -> None:
        self.view: RenderableType = Text("")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.view


class MarkdownStream:
    """Streamed reply text to a terminal console as rendered markdown (see the module)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.splitter = BlockSplitter()
        self._open = _Open()
        self._live: Live | None = None
        self._shown = 0  # blocks printed so far
        self._drawn = 0.0  # when the open block was last drawn
        self._interval = REFRESH_S  # the least time between two drawings
        self._stale = False  # the open block changed since it was drawn

    def feed(self, text: str) -> None:
        blocks = self.splitter.feed(text)
        self._stale = True
        if blocks:
            self._print(blocks)
        elif time.perf_counter() - self._drawn >= self._interval:
            self._draw()

    def close(self) -> None:
        """The reply ended (or stopped): the open block is finished and printed."""
        self._print(self.splitter.close())
        if self._live is not None:
            self._live.stop()  # transient: the (empty) region goes
            self._live = None
        self._shown = 0
        self._stale = False

    def _print(self, blocks: list[Block]) -> None:
        """Finished blocks, printed for good above the region, which then shows the new
        open block: rich writes both at once (one redraw)."""
        for i, block in enumerate(blocks):
            gap = self._shown > 0  # blocks are apart by a blank line, as in rich's Markdown
            self._shown += 1
            if i == len(blocks) - 1:
                self._open.view = self._view()
                self._drawn = time.perf_counter()
                self._interval = REFRESH_S  # a new open block: small again
                self._stale = False
            shown = rendered(block)
            self.console.print(
                Group(Text(""), shown) if gap else shown, soft_wrap=block.code is not None
            )

    def _view(self) -> RenderableType:
        block = self.splitter.open_block
        if block is None:
            return Text("")
        # The region stays smaller than the screen, or rich could not redraw it in place.
        view: RenderableType = _Tail(rendered(block), max(self.console.height - 3, 1))
        return Group(Text(""), view) if self._shown else view

    def _draw(self) -> None:
        start = self._drawn = time.perf_counter()
        if not self._stale:
            return
        self._stale = False
        self._open.view = self._view()
        self._refresh()
        self._interval = max(REFRESH_S, (time.perf_counter() - start) / DRAW_SHARE)

    def _refresh(self) -> None:
        if self._live is None:
            self._live = Live(
                self._open,
                console=self.console,
                auto_refresh=False,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start(refresh=True)
        else:
            self._live.refresh()
