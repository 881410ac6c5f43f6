"""Imports run down the layers declared in exokv/layers.py: a module imports from its own
layer and the layers below, never up; and every module is placed in a layer."""

from __future__ import annotations

import ast
from pathlib import Path

import exokv
from exokv.layers import LAYERS, layer_of

PACKAGE = Path(exokv.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, root: Path) -> bool:
    base = root.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or base.is_dir()


def imported(path: Path, root: Path) -> list[tuple[int, str]]:
    """Every exokv module `path` imports (at any depth: in functions, under TYPE_CHECKING),
    with its line: `from a.b import c` counts as a.b.c when c is a module, else as a.b."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((node.lineno, sub if is_module(sub, root) else source))
    top = root.name
    return [(line, m) for line, m in found if m == top or m.startswith(top + ".")]


def violations(root: Path) -> list[str]:
    """One line per upward import or unplaced module under the package at `root`."""
    names = [n for n, _ in LAYERS]
    problems = []
    for path in sorted(root.rglob("*.py")):
        where = f"{path.relative_to(root.parent)}"
        layer = layer_of(module_name(path, root))
        if layer is None:
            problems.append(f"{where}: {module_name(path, root)} is in no layer (exokv/layers.py)")
            continue
        for line, target in imported(path, root):
            up = layer_of(target)
            if up is not None and up > layer:
                problems.append(
                    f"{where}:{line} imports {target} ({names[up]}) "
                    f"from {names[layer]}, a layer below"
                )
    return problems


def test_no_module_imports_from_a_higher_layer_and_every_module_has_one() -> None:
    assert violations(PACKAGE) == []


def test_the_layers_are_read_from_the_package() -> None:
    names = [n for n, _ in LAYERS]
    order = ["ground", "cache", "wire", "rank", "client", "front ends", "cli"]
    assert [n for n in names if n in order] == order
    assert layer_of("exokv.cache.radix") == names.index("cache")
    assert layer_of("exokv.rank.engine") == names.index("rank")
    assert layer_of("exokv.client") == names.index("client")
    assert layer_of("exokv") == 0
    assert layer_of("exokv.serve") is None  # the root does not place what is under it


def fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "exokv"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_an_upward_import_inside_a_function_is_named(tmp_path: Path) -> None:
    root = fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "cache/tier.py": "def f():\n    from exokv.rank import engine\n",
            "rank/__init__.py": "",
            "rank/engine.py": "from exokv.cache import tier\n",
        },
    )
    assert violations(root) == [
        "exokv/cache/tier.py:2 imports exokv.rank.engine (rank) from cache, a layer below"
    ]


def test_relative_and_type_checking_imports_count(tmp_path: Path) -> None:
    root = fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "wire/__init__.py": "",
            "wire/channel.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ..client import Client\n"
            ),
            "client/__init__.py": "class Client: ...\n",
        },
    )
    assert violations(root) == [
        "exokv/wire/channel.py:3 imports exokv.client (client) from wire, a layer below"
    ]


def test_a_module_in_no_layer_fails(tmp_path: Path) -> None:
    root = fake_package(tmp_path, {"__init__.py": "", "serve/app.py": "import exokv.client\n"})
    assert violations(root) == [
        "exokv/serve/app.py: exokv.serve.app is in no layer (exokv/layers.py)"
    ]
