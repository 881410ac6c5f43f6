"""Replies rendered as markdown while they stream: what the rendering costs.

    python benchmarks/markdown.py [--turns 8] [--tps 200] [--json]

1. Rendering alone. A markdown reply of about 2,000 tokens (headings, paragraphs with
   emphasis, lists, a table, Python fences) is cut into tokens by SmolLM2's tokenizer
   (converted on this machine: EXOKV_MODELS/smollm2/tokenizer.json; else 4 characters
   a piece, and the output says so) and fed to the REPL's Renderer, one token per
   `on_text` call as the model streams it, on a terminal console writing to memory:
   as fast as it goes, and at --tps tokens per second. Reported: the time spent in
   `on_text`/`end_turn` in all (what rendering takes from the reply), and per token
   (p50, p99, max), with markdown and with --plain (raw text).
2. In a pseudo-terminal. The real REPL on builtin:tiny, with EXOKV_TEST_SHOWN_REPLY set
   to that reply (the model's pace, that reply's text on the screen). While a reply
   keys typed are not echoed (they wait for the next prompt), so the key that acts on a
   streaming reply is Ctrl-C: sent --at seconds after the reply's first characters, the
   time until the status line (`interrupted`) is on the screen, one per turn. And the
   gaps between the screen's updates while the reply streams (p50, p99). Markdown and
   --plain, --turns turns each, in one REPL each.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from resume import Trial  # noqa: E402

PARAGRAPH = (
    "The **prefix cache** keeps the keys and values of every prompt it has seen, so a "
    "conversation that goes on pays only for its *new* tokens. A turn that shares a long "
    "beginning with an earlier one, such as `/retry`, starts almost at once."
)
CODE = '''def fibonacci(n: int) -> list[int]:
    """The first n Fibonacci numbers."""
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])  # the sum of the last two
    return numbers[:n]


if __name__ == "__main__":
    print(fibonacci(10))'''


def reply_text(sections: int) -> str:
    parts = []
    for i in range(sections):
        parts.append(f"## Step {i + 1}: what happens\n")
        parts.append(PARAGRAPH + "\n")
        parts.append("- the first point, with `code`\n- the second, **bold**\n- the third\n")
        parts.append(f"```python\n{CODE}\n```\n")
        parts.append("| tokens | seconds |\n|---|---|\n| 2,000 | 1.3 |\n| 4,000 | 2.1 |\n")
    return "\n".join(parts)


def tokens(text: str) -> tuple[list[str], str]:
    """The reply cut into the pieces a model streams, and how it was cut."""
    models = Path(os.environ.get("EXOKV_MODELS", Path.home() / ".cache/exokv/models"))
    path = models / "smollm2" / "tokenizer.json"
    try:
        from tokenizers import Tokenizer

        enc = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False)
        cuts = [start for start, _ in enc.offsets] + [len(text)]
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        if "".join(pieces) == text:
            return pieces, "SmolLM2's tokenizer"
    except Exception:  # noqa: BLE001 - fall back to fixed pieces
        pass
    return [text[i : i + 4] for i in range(0, len(text), 4)], "4 characters a piece"


def render_alone(pieces: list[str], plain: bool, tps: float) -> dict[str, Any]:
    from rich.console import Console

    from exokv.chat.render import Renderer

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, height=50, color_system="256")
    renderer = Renderer(console, Console(file=io.StringIO()), plain=plain)
    each = []
    renderer.begin_turn()
    start = time.perf_counter()
    for i, piece in enumerate(pieces):
        if tps:
            wait = start + i / tps - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        t = time.perf_counter()
        renderer.on_text(piece)
        each.append(time.perf_counter() - t)
    t = time.perf_counter()
    renderer.end_turn()
    last = time.perf_counter() - t
    return {
        "total_s": round(sum(each) + last, 4),
        "end_turn_s": round(last, 4),
        "per_token_ms": _quantiles([e * 1000 for e in each]),
        "bytes_written": len(out.getvalue()),
    }


def _quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": round(q[49], 3), "p99": round(q[98], 3), "max": round(values[-1], 3)}


def in_a_pty(reply: Path, plain: bool, turns: int, at: float) -> dict[str, Any]:
    os.environ["EXOKV_TEST_SHOWN_REPLY"] = str(reply)
    home = Path(tempfile.mkdtemp(prefix="exokv-md-"))
    trial = Trial(home, "builtin:tiny", 4000, *(["--plain"] if plain else []))
    stops, gaps = [], []
    try:
        trial.wait_for(r"demo › ")
        for turn in range(turns):
            mark = len(trial.raw)
            os.write(trial.fd, f"Tell me about step {turn}.\r".encode())
            trial.wait_for(r"Step 1", start=mark, timeout=120)  # the reply is on the screen
            begin = time.perf_counter()
            while time.perf_counter() - begin < at:
                trial._read(0.005)
            chunks = [t for t, end in trial.chunks if end > mark]
            gaps += [b - a for a, b in zip(chunks, chunks[1:], strict=False)]
            mark = len(trial.raw)
            sent = time.perf_counter()
            os.write(trial.fd, b"\x03")
            trial.wait_for(r"interrupted", start=mark, timeout=120)
            seen = next(
                t for t, end in trial.chunks if end > mark and b"interrupted" in trial.raw[mark:end]
            )
            stops.append(seen - sent)
            mode = "plain" if plain else "markdown"
            print(f"{mode} turn {turn}: Ctrl-C to screen {seen - sent:.3f} s", file=sys.stderr)
            trial.wait_for(r"demo › ", start=mark, timeout=120)
    finally:
        trial.quit()
    return {
        "ctrl_c_to_screen_ms": _quantiles([s * 1000 for s in stops]),
        "screen_update_gap_ms": _quantiles([g * 1000 for g in gaps]),
        "turns": turns,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", type=int, default=11, help="about 180 tokens each")
    parser.add_argument("--tps", type=float, default=200.0)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--at", type=float, default=1.0, help="Ctrl-C this long into a reply")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    text = reply_text(args.sections)
    pieces, how = tokens(text)
    result: dict[str, Any] = {"reply_tokens": len(pieces), "cut_by": how, "render": {}, "pty": {}}
    for mode in ("markdown", "plain"):
        result["render"][mode] = {
            "as_fast_as_it_goes": render_alone(pieces, mode == "plain", 0),
            f"at_{args.tps:g}_tps": render_alone(pieces, mode == "plain", args.tps),
        }
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
        f.write(text)
    for mode in ("markdown", "plain"):
        result["pty"][mode] = in_a_pty(Path(f.name), mode == "plain", args.turns, args.at)
    os.unlink(f.name)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
