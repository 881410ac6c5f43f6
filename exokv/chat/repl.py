"""The interactive chat: prompt-toolkit line editing, rich output.

Keys (also in the README and /help):
- Enter sends the line. Esc then Enter (Meta+Enter, Option+Enter on a Mac set to use
  Option as Meta) inserts a new line; so does Enter after a line ending in ``\\``
  (the backslash is removed). Pasted text keeps its new lines.
- Tab completes slash commands and, after ``/switch``, session names.
- Up/Down walk the history, kept in ``EXOKV_HOME/history`` across runs.
- Ctrl-C while a reply is generated stops it at the next token (or at the next
  prefill chunk) and returns to the prompt. The part of the reply produced so far
  is KEPT in the conversation (it is on screen, and it is in the KV cache): `/retry`
  regenerates it in full, `/undo` drops the exchange. A reply stopped before its
  first token leaves nothing. More Ctrl-C only say that the reply is stopping: no
  number of them leaves exokv, so a session is never lost to an impatient key.
- Ctrl-C at the prompt clears the line; Ctrl-D on an empty line (or /quit) quits,
  saving the current session's KV cache, then says `bye`.
- What is typed or pasted while no prompt is shown (a reply streams, the ranks start
  again, a command runs, the instant between a status line and the next prompt) is
  not echoed and waits, in order, for the next prompt (exokv.chat.repl._quiet_terminal).
- With standard output redirected (`exokv chat > log.txt`) the reply, the bar and the
  status line stay on the terminal (standard error) and the file gets a transcript.
"""

from __future__ import annotations

import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import IO, Any

from prompt_toolkit import PromptSession
from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
from prompt_toolkit.buffer import CompletionState
from prompt_toolkit.completion import (
    CompleteEvent,
    Completer,
    Completion,
    get_common_complete_suffix,
)
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.output import Output, create_output
from prompt_toolkit.patch_stdout import patch_stdout
from prompt_toolkit.styles import Style
from rich.console import Console

from exokv.cache.tier_options import shown_disk_budget
from exokv.chat.conversation import COMMANDS, TAKES_ARGUMENT, ChatController, Outcome
from exokv.chat.render import BannerInfo, Renderer
from exokv.chat.typeahead import DraftWatcher, PrefillSpeed, toolbar_text
from exokv.client import Client
from exokv.config import debug_enabled, exokv_home
from exokv.core.options import ClusterOptions
from exokv.core.records import TIER_OFF_BECAUSE
from exokv.errors import ExokvError

HISTORY_FILE = "history"

STYLE = Style.from_dict(
    {
        "session": "ansicyan",
        "arrow": "ansibrightblack",
        "bottom-toolbar": "noreverse ansibrightblack",
    }
)


class ChatCompleter(Completer):
    """Slash commands at the start of the line; session names after /switch (every one
    but the current) and after /pin and /unpin (every one)."""

    def __init__(self, chat: ChatController) -> None:
        self.chat = chat

    def get_completions(self, document: Document, complete_event: Any) -> Iterator[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/") or "\n" in text:
            return
        if " " not in text:
            for name, meta in COMMANDS.items():
                if name.startswith(text):
                    # A command that takes an argument comes with its space, ready for it.
                    full = name + " " if name in TAKES_ARGUMENT else name
                    yield Completion(
                        full, start_position=-len(text), display=name, display_meta=meta
                    )
            return
        command, _, arg = text.partition(" ")
        if command not in ("/switch", "/pin", "/unpin"):
            return
        arg = arg.lstrip()
        try:
            names = sorted(self.chat.known_sessions())
        except ExokvError:
            return  # the database is busy: no completion rather than an error
        for name in names:
            if name.startswith(arg) and (command != "/switch" or name != self.chat.current.name):
                yield Completion(name, start_position=-len(arg))


def key_bindings() -> KeyBindings:
    kb = KeyBindings()

    @kb.add("enter")
    @kb.add("c-j")
    def _enter(event: KeyPressEvent) -> None:
        buf = event.current_buffer
        state = buf.complete_state
        if state is not None and state.current_completion is not None:
            buf.apply_completion(state.current_completion)
            return
        before = buf.document.text_before_cursor
        if before.endswith("\\") and not buf.document.text_after_cursor.strip():
            buf.delete_before_cursor(1)
            buf.insert_text("\n")
            return
        buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    @kb.add("tab")
    def _tab(event: KeyPressEvent) -> None:
        complete_now(event.current_buffer)

    return kb


def complete_now(buf: Any) -> None:
    """Tab, completed at once from the completer (which reads no more than the store).

    prompt-toolkit's own Tab starts a completion in the background, and drops it while
    the one typing started is still running: a Tab typed in the same burst as `/sw`
    was lost. Here one completion is applied; several extend the line by what they
    share and open the menu; a menu open already moves to its next entry."""
    if buf.complete_state is not None:
        buf.complete_next()
        return
    found = _completions(buf)
    if len(found) == 1:
        buf.apply_completion(found[0])
    elif found:
        common = get_common_complete_suffix(buf.document, found)
        if common:
            buf.insert_text(common)
            found = _completions(buf)
        buf.complete_state = CompletionState(buf.document, found)


def _completions(buf: Any) -> list[Completion]:
    if buf.completer is None:
        return []
    return list(
        buf.completer.get_completions(buf.document, CompleteEvent(completion_requested=True))
    )


def _history() -> History:
    home = exokv_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
        path = home / HISTORY_FILE
        path.touch(exist_ok=True)
        return FileHistory(str(path))
    except OSError:
        return InMemoryHistory()


class _Interrupts:
    """SIGINT for the whole REPL: during a turn it stops the reply; it never leaves exokv.

    At the prompt, Ctrl-C is a key for prompt-toolkit (the terminal is in raw mode), so
    this handler sees only the Ctrl-C pressed while a turn runs or between turns, where
    Python's default would raise KeyboardInterrupt and end the chat without saving.
    """

    def __init__(self, client: Client, renderer: Renderer) -> None:
        self.client = client
        self.renderer = renderer
        self.count = 0
        self.in_turn = False

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.in_turn:
            return
        self.count += 1
        if self.count == 1:
            self.client.stop()
        elif self.count == 2:
            self.renderer.note("\n(stopping at the next step; the session is kept)")

    @contextmanager
    def turn(self) -> Iterator[None]:
        self.count = 0
        self.in_turn = True
        try:
            yield
        finally:
            self.in_turn = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only (e.g. an in-process test)
            return
        previous = signal.signal(signal.SIGINT, self)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


@contextmanager
def _quiet_terminal() -> Iterator[None]:
    """From the first prompt to the last, keys that come between prompts wait for the
    next one, byte for byte, and nothing echoes them.

    prompt-toolkit puts the terminal in raw mode only while a prompt is shown; out of
    it the terminal would be in cooked mode, where a paste that comes the instant a
    status line appears is echoed raw, kept only up to the line discipline's limit
    (4,095 bytes on Linux, 1,024 on macOS), edited by the line discipline (^U, ^W,
    backspace) and flushed by a Ctrl-C. Here, between prompts, the terminal reads
    bytes as they come (no ICANON), echoes nothing, keeps its input on a Ctrl-C
    (NOFLSH), and still turns Ctrl-C into SIGINT (ISIG) to stop a reply.
    prompt-toolkit's raw mode saves and restores this mode around every prompt.
    """
    try:
        import termios  # POSIX only: on Windows, keys are left as they are
    except ImportError:
        yield
        return
    try:
        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError, AttributeError):
        yield  # not a terminal (a test's pipe): nothing is echoed anyway
        return
    quiet = termios.tcgetattr(fd)
    quiet[0] &= ~(termios.IXON | termios.IXOFF | termios.ICRNL | termios.INLCR | termios.IGNCR)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL | termios.ICANON | termios.IEXTEN)
    quiet[3] |= termios.NOFLSH
    quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 1, 0
    try:
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except termios.error:
        yield
        return
    try:
        yield
    finally:
        try:
            termios.tcsetattr(fd, termios.TCSANOW, saved)
        except termios.error:
            pass


class Transcript:
    """`exokv chat > log.txt`: the user's lines and the replies, as plain text."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def turn(self, line: str, outcome: Outcome) -> None:
        if outcome.result is None:
            return
        if outcome.command != "/retry":
            sent = line.lstrip()[1:] if line.lstrip().startswith("//") else line
            self.out.write(f"user: {sent}\n")
        else:
            self.out.write("(retried)\n")
        self.out.write(f"assistant: {outcome.result.reply}\n\n")
        self.out.flush()


def banner_info(chat: ChatController, client: Client, opts: ClusterOptions) -> BannerInfo:
    ranks = client.ranks
    return BannerInfo(
        model=opts.model,
        ranks=ranks,
        parallel=opts.parallel if ranks > 1 else None,
        split=",".join(map(str, opts.split)) if ranks > 1 and opts.split else None,
        budgets=list(client.budgets),
        session=chat.current.name,
        no_cache=opts.no_cache,
        disk_budget=_disk_budget(opts),
        disk_off=_disk_off(client, chat) if _tier_asked(opts) else None,
    )


def _tier_asked(opts: ClusterOptions) -> bool:
    return bool(getattr(opts, "disk_budget", None)) and not opts.no_cache


def _disk_off(client: Client, chat: ChatController) -> str | None:
    """Why the ranks have no disk tier though one was asked for (another chat holds it)."""
    try:
        report = client.cache_held(chat.current.name, [{"role": "user", "content": ""}])
    except Exception:  # noqa: BLE001 - the banner never fails a chat
        return None
    skipped = report.skipped or ""
    return skipped.removeprefix(TIER_OFF_BECAUSE) if skipped.startswith(TIER_OFF_BECAUSE) else None


def _disk_budget(opts: ClusterOptions) -> int | None:
    try:
        return shown_disk_budget(opts)
    except Exception:  # noqa: BLE001 - the banner never fails a chat
        return None


def run_repl(
    chat: ChatController,
    client: Client,
    opts: ClusterOptions,
    *,
    typeahead: bool = True,
    input: Input | None = None,
    output: Output | None = None,
    renderer: Renderer | None = None,
    plain: bool = False,
) -> int:
    """Read lines until /quit or Ctrl-D; saves the session's KV cache, says bye; exit code.

    `opts`: what the ranks were started with (the banner shows it); `typeahead`: send
    drafts of the line being typed (off with --no-typeahead); `plain`: replies as raw text."""
    transcript = None
    # Lines printed while a prompt is shown (a thread saying a rank failed) go through
    # prompt-toolkit, which prints them above the line being edited and redraws it: on
    # the terminal of prompt-toolkit's default session (its writer thread sees only
    # that one), so not with a redirected stdout or a test's own input and output.
    above = output is None and input is None and sys.stdout.isatty()
    if output is None and not sys.stdout.isatty() and sys.stderr.isatty():
        # Everything for the eyes stays on the terminal; the redirected stdout gets a
        # transcript.
        output = create_output(stdout=sys.stderr)
        transcript = Transcript(sys.stdout)
        if renderer is None:
            renderer = Renderer(Console(stderr=True, highlight=False), plain=plain)
    renderer = renderer or Renderer(plain=plain)
    renderer.banner(banner_info(chat, client, opts))
    chat.hooks.attach(warn=renderer.warning, note=renderer.note)
    session = _prompt_session(chat, input, output)
    interrupts = _Interrupts(client, renderer)
    watcher = _draft_watcher(chat, client, typeahead, session)
    speed = PrefillSpeed()
    if watcher is not None:
        # What Enter will cost, while a draft is typed; redrawn as the ranks step it.
        draft = watcher
        session.bottom_toolbar = lambda: toolbar_text(draft.cost(), speed.tps)
        session.refresh_interval = session.app.refresh_interval = 0.5
    quiet = _quiet_terminal() if input is None else nullcontext()
    with quiet, interrupts.installed(), warnings.catch_warnings():
        # A warning from a library (asyncio's "never awaited" after a signal) is noise
        # on the chat's screen; EXOKV_DEBUG=1 shows them.
        if not debug_enabled():
            warnings.simplefilter("ignore", RuntimeWarning)
        try:
            _loop(chat, session, renderer, interrupts, transcript, watcher, above, speed)
        finally:
            if watcher is not None:
                watcher.close()
        chat.hooks.finish(chat)
    renderer.note("bye")
    return 0


def _prompt_session(
    chat: ChatController, input: Input | None, output: Output | None
) -> PromptSession[str]:
    """The line editor: history (in memory for a test's own input), completion, keys."""
    return PromptSession(
        history=_history() if input is None else InMemoryHistory(),
        completer=ChatCompleter(chat),
        complete_while_typing=True,
        auto_suggest=AutoSuggestFromHistory(),
        key_bindings=key_bindings(),
        multiline=True,
        prompt_continuation=lambda width, line, wrap: "." * (width - 1) + " ",
        style=STYLE,
        input=input,
        output=output,
        enable_open_in_editor=False,
    )


def _draft_watcher(
    chat: ChatController, client: Client, typeahead: bool, session: PromptSession[str]
) -> DraftWatcher | None:
    """Typing ahead (exokv.chat.typeahead): on, unless --no-typeahead or there is no cache."""
    if not typeahead or not chat.settings.use_cache:
        return None
    watcher = DraftWatcher(client, lambda: (chat.current.name, chat.current.prompt()))
    watcher.attach(session.default_buffer)
    return watcher


def _loop(
    chat: ChatController,
    session: PromptSession[str],
    renderer: Renderer,
    interrupts: _Interrupts,
    transcript: Transcript | None,
    watcher: DraftWatcher | None = None,
    above: bool = False,
    speed: PrefillSpeed | None = None,
) -> None:
    while True:
        message = [("class:session", chat.current.name), ("class:arrow", " › ")]
        if watcher is not None:
            watcher.resume()
        try:
            with patch_stdout(raw=True) if above else nullcontext():
                line = session.prompt(message)
        except KeyboardInterrupt:
            if watcher is not None:
                watcher.hold(abandon=True)
            renderer.note("(Ctrl-D or /quit leaves; Ctrl-C while a reply streams stops it)")
            continue
        except EOFError:
            return
        if watcher is not None:
            text = line.lstrip()
            watcher.hold(abandon=not text or (text.startswith("/") and not text.startswith("//")))
        if not line.strip():
            continue
        renderer.begin_turn()
        try:
            with interrupts.turn():
                outcome = chat.handle(
                    line, on_text=renderer.on_text, on_progress=renderer.on_progress
                )
        except ExokvError as err:
            renderer.end_turn()
            if interrupts.client.failure:
                raise  # the ranks are gone: no prompt that cannot work; exit 1, said once
            renderer.error(str(err))
            continue
        renderer.end_turn()
        if outcome is None:
            continue
        if outcome.quit:
            return
        renderer.outcome(outcome)
        if speed is not None and outcome.result is not None:
            speed.turn(outcome.result.prefilled_tokens, outcome.result.ttft_s)
        if transcript is not None:
            transcript.turn(line, outcome)
