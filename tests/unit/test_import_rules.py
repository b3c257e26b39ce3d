"""The layering rule, one declared graph read from the source with ast: which meshtrain
packages each package may import (anywhere in a file, function bodies too), with no cycle
among them; the parallelisms stay model- and loader-agnostic (no config loader, no model
family, no trainer); and no model family imports another (what two families share lives in
a shared module of `models/`)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = sorted(p.parent.name for p in (ROOT / "models").glob("*/__init__.py"))

# package -> the meshtrain packages it may import (train.py and scripts/ may import anything)
ALLOWED = {
    "models": set(),  # the model files know no parallelism, trainer or config loader
    "metrics": set(),  # the trainer passes plain values in
    "data": set(),
    "job_config": {"data"},  # the dataset kinds it validates
    "parallelisms": {"models", "metrics", "job_config"},  # job_config's schema, not its loader
    "checkpoint": {"models", "data"},
    "planning": {"models", "parallelisms"},
    "training": {
        "models",
        "metrics",
        "data",
        "job_config",
        "parallelisms",
        "checkpoint",
        "planning",
    },  # fmt: skip
}
# imports a package may not make although its package is allowed
BANNED = {"parallelisms": ("job_config.loader",)}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (function bodies too): `import a.b` gives
    a.b, `from a import b` both a and a.b (b may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def edges() -> set[tuple[str, str, str]]:
    """(importing package, imported module, file) for every import of a meshtrain package
    by another package's file."""
    out = set()
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            for module in imported_modules(path):
                top = module.split(".")[0]
                if top != package and (top in ALLOWED or top == "train"):
                    out.add((package, module, str(path.relative_to(ROOT))))
    return out


def family_imports() -> set[tuple[str, str]]:
    out = set()
    for family in FAMILIES:
        for path in (ROOT / "models" / family).rglob("*.py"):
            for module in imported_modules(path):
                parts = module.split(".")
                if parts[0] == "models" and len(parts) > 1 and parts[1] in FAMILIES:
                    if parts[1] != family:
                        out.add((family, parts[1]))
    return out


def test_the_rule_sees_every_form_of_import(tmp_path):
    assert FAMILIES and "llama3" in FAMILIES
    source = tmp_path / "example.py"
    source.write_text(
        "import train\nfrom job_config import loader\nimport training_data\n"
        "def f():\n    from models.moe import MoE\n"
        "from job_config.problems import Problems\nfrom models.attention import attend\n"
    )
    assert imported_modules(source) >= {"train", "job_config.loader", "models.moe",
                                        "models.attention.attend"}  # fmt: skip
    assert "training" not in imported_modules(source)  # training_data is another module


def test_the_packages_import_only_what_the_declared_graph_allows():
    graph = {(a, b) for a, targets in ALLOWED.items() for b in targets}
    for a, b in itertools.permutations(ALLOWED, 2):  # the declared graph has no cycle
        assert not ((a, b) in graph and _reaches(graph, b, a)), f"cycle through {a} and {b}"
    found = edges()
    assert found, "the rule reads no import"
    bad = sorted(f"{file}: {module}" for package, module, file in found
                 if module.split(".")[0] not in ALLOWED[package]
                 or any(module == b or module.startswith(b + ".") for b in BANNED.get(package, ())))  # fmt: skip
    assert not bad, "imports across the declared package graph:\n" + "\n".join(bad)
    assert ("parallelisms", "models") in {(a, m.split(".")[0]) for a, m, _ in found}
    parallel_family = sorted(f for a, m, f in found if a == "parallelisms"
                             and m.split(".")[:2] in ([["models", x] for x in FAMILIES]))  # fmt: skip
    assert not parallel_family, f"parallelisms import a model family: {parallel_family}"
    assert not family_imports(), f"a family imports another: {sorted(family_imports())}"


def _reaches(graph: set[tuple[str, str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo += [b for a, b in graph if a == node]
    return False
