"""The suite's own rule for ranks' ports: every test that starts ranks passes a
--starting-port of its own. Two files on the two xdist workers with one port join
each other's rings (rank 1 of one reaches rank 0 of the other), and the test that
loses hangs until its timeout. Only the literal `"--starting-port", "N"` is read here:
ports passed as parameters or helpers' arguments are the writer's to keep apart."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent
PORT = re.compile(r'"--starting-port", "(\d+)"')


def test_no_two_places_in_the_suite_pass_the_same_starting_port() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sorted(TESTS.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for port in PORT.findall(line):
                seen[port].append(f"{path.name}:{number}")
    assert len(seen) > 20  # the pattern still finds the suite's ports
    shared = {port: places for port, places in seen.items() if len(places) > 1}
    assert not shared, shared
