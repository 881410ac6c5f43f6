"""The settings registry (exokv.config.SETTINGS) and docs/settings.md agree."""

from __future__ import annotations

from pathlib import Path

from exokv.config import API_KEY, FORWARDED_ENV, SETTINGS, TEST_HOOKS

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


def test_production_code_reaches_the_test_hooks_only_through_test_hooks() -> None:
    """One seam: outside config.py no module reads an EXOKV_* variable from the
    environment, and config reads each test hook in a method of `TEST_HOOKS` (no
    module-level reader of a hook), so that one name finds every place a test reaches."""
    package = Path(__file__).resolve().parent.parent / "exokv"
    readers = ("os.environ", "os.getenv", "environ.get")
    problems = [
        f"{path.relative_to(package.parent)}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "config.py"
        for line in path.read_text().splitlines()
        if "EXOKV_" in line and any(r in line for r in readers)
    ]
    assert problems == []
    config = (package / "config.py").read_text()
    hooks_at = config.index("class TestHooks")
    for s in SETTINGS:
        if s.test:
            constant = s.name.removeprefix("EXOKV_")
            uses = [i for i in range(len(config)) if config.startswith(constant + ".", i)]
            assert uses and all(i > hooks_at for i in uses), f"{s.name} read outside TestHooks"
    assert callable(TEST_HOOKS.fail_at) and callable(TEST_HOOKS.host_memory)
