"""The settings registry (exokv.config.SETTINGS) and docs/settings.md agree."""

from __future__ import annotations

from pathlib import Path

from exokv.config import API_KEY, FORWARDED_ENV, SETTINGS

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_the_doc_lists_every_setting_as_registered() -> None:
    doc = DOC.read_text()
    for s in SETTINGS:
        row = (
            f"| `{s.name}` | {s.kind} | {s.help} |"
            if s.test
            else f"| `{s.name}` | {s.kind} | {s.default} | {s.help} |"
        )
        assert row in doc, f"docs/settings.md lacks {s.name} as registered: {row}"


def test_every_setting_is_named_once_and_test_hooks_say_so() -> None:
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    assert all(n.startswith("EXOKV_") for n in names)
    for s in SETTINGS:
        assert s.test == s.name.startswith("EXOKV_TEST_"), s.name


def test_ranks_elsewhere_inherit_only_what_is_marked_and_never_the_key() -> None:
    assert FORWARDED_ENV == tuple(s.name for s in SETTINGS if s.forwarded)
    assert API_KEY.name not in FORWARDED_ENV
    assert {"EXOKV_DEBUG", "EXOKV_RANK_LOG", "EXOKV_TEST_FAIL_AT"} <= set(FORWARDED_ENV)
