"""Imports run down the layers declared in exokv/layers.py: a module imports from its own
layer and the layers below, never up; every module is placed in a layer; and no two
modules import each other, however many steps apart and wherever the import sits (in a
function, under TYPE_CHECKING), inside a layer as across layers."""

from __future__ import annotations

import ast
import subprocess
import sys
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


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module's exokv imports, as modules (a package's __init__ is not counted from
    inside that package: importing a submodule runs it, which is no cycle of the code)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        graph[name] = {
            target
            for _, target in imported(path, root)
            if target != name and not name.startswith(target + ".")
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycle_counting_imports_inside_functions() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_a_cycle_inside_one_layer_is_found(tmp_path: Path) -> None:
    root = fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "serve/__init__.py": "",
            "serve/api.py": "from exokv.serve.tools import read\n",
            "serve/tools.py": "def read():\n    from exokv.serve import api\n",
            "serve/app.py": "from exokv.serve import api, tools\n",
        },
    )
    assert cycles(import_graph(root)) == [["exokv.serve.api", "exokv.serve.tools"]]


def unexplained_inner_imports(root: Path) -> list[str]:
    """Imports inside a function that say nothing of why: each must have a comment on its
    line or on the line above it (one comment covers a run of imports one after another).
    The top of the module is where a reader looks for what a module needs; an import is
    put off only where start-up needs it (mlx-lm and transformers take seconds to import,
    and the front end, which never runs the model, must not pay for them) or to keep a
    layer's own start light, and the comment says which."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines), str(path))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                line = node.lineno - 1
                above = line - 1
                while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
                    above -= 1  # the run of imports this one belongs to
                said = "#" in lines[line] or (above >= 0 and lines[above].strip().startswith("#"))
                if not said:
                    problems.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return sorted(set(problems))


def test_every_import_inside_a_function_says_why() -> None:
    assert unexplained_inner_imports(PACKAGE) == []


def test_an_inner_import_without_a_reason_is_named(tmp_path: Path) -> None:
    root = fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": (
                "def f():\n    import json\n\n"
                "def g():\n    # mlx-lm takes seconds to import: only the ranks need it\n"
                "    import mlx_lm\n    import mlx.core as mx\n\n"
                "def h():\n    import psutil  # only on this path\n"
            ),
        },
    )
    assert unexplained_inner_imports(root) == ["exokv/a.py:2"]


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
    assert layer_of("exokv.nowhere") is None  # the root does not place what is under it


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
    root = fake_package(tmp_path, {"__init__.py": "", "nowhere/app.py": "import exokv.client\n"})
    assert violations(root) == [
        "exokv/nowhere/app.py: exokv.nowhere.app is in no layer (exokv/layers.py)"
    ]


FRONT_END_MODULES = (
    "exokv.cli.app",
    "exokv.frontend.start",
    "exokv.chat.run",
    "exokv.serve.run",
    "exokv.client.cluster",
    "exokv.client.heal",
)


def test_the_front_end_starts_without_the_model_libraries() -> None:
    """What the deferred imports are for: the front end of a chat on ranks, and every
    command that never runs the model (`--help`, `cache stats`), start without mlx-lm and
    transformers, seconds of import each; the ranks load them."""
    code = (
        "import importlib, sys\n"
        f"for name in {FRONT_END_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in ('mlx_lm', 'transformers', 'mlx.nn') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
