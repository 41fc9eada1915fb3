"""The package's layers, as docs/ARCHITECTURE.md draws them, checked on the source: what
each folder may import, no import cycles between modules or folders, a torch-free core,
and files that stay readable."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokenmill"
BASE = {"config", "sampling_params", "outputs", "reasoning"}
# Each unit (a folder, or a top-level module) and the units it may import. The
# tools on top (server, bench, profile, plan, train and the command modules) may
# import anything below them; cycles are ruled out separately.
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "sampling_params": set(),
    "outputs": set(),
    "reasoning": set(),
    "chat": set(),
    "core": BASE,
    "kv": set(),
    "attention": BASE | {"kv", "layers"},
    "layers": BASE,
    "model": {"layers", "attention", "kv"},
    "dist": BASE | {"layers", "model"},
    "quant": BASE | {"layers"},
    "runner": BASE | {"core", "attention", "kv", "layers", "model"},
    "speculative": BASE | {"core", "attention", "kv", "layers", "model", "runner"},
    "worker": BASE | {"core", "attention", "kv", "layers", "model", "runner", "speculative",
                      "dist", "quant", "chat"},
    "executor": BASE | {"core", "model", "worker", "dist"},
    "engine": BASE | {"core", "executor", "speculative", "chat"},
    "llm": BASE | {"engine", "chat"},
}
MAX_FILE_LINES = 400


def unit_of(module: str) -> str:
    parts = module.split(".")[1:]
    return parts[0] if parts else "__init__"


def module_imports() -> dict[str, set[str]]:
    """tokenmill module -> the tokenmill modules it imports (anywhere in the file)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokenmill"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return module_imports()


def test_each_layer_imports_only_what_lies_below_it(graph):
    wrong = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                   if unit_of(a) in ALLOWED and unit_of(a) != unit_of(b)
                   and unit_of(b) not in ALLOWED[unit_of(a)])
    assert not wrong, wrong


def test_no_import_cycles_between_modules_or_folders(graph):
    assert find_cycle(graph) is None, find_cycle(graph)
    folders: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        folders[unit_of(a)] |= {unit_of(b) for b in targets if unit_of(b) != unit_of(a)}
    assert find_cycle(folders) is None, find_cycle(folders)


def test_the_core_and_the_config_import_without_torch():
    code = ("import sys, tokenmill.config, tokenmill.core.scheduler, tokenmill.core.step, "
            "tokenmill.core.kv_manager, tokenmill.speculative.registry; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_files_stay_readable():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long
