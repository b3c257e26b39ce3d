"""The layering rules, read from the source with ast: the parallelisms are model- and
loader-agnostic, so no module under parallelisms/ imports the config loader, a model family's
package or the entry script (nor, above them, training/ or checkpoint/). The checks that need a
family or the loader live in training/preflight.py; `job_config.problems` and the shared
`models` modules are fine."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = sorted(p.parent.name for p in (ROOT / "models").glob("*/__init__.py"))


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


def forbidden(module: str) -> bool:
    banned = ["train", "training", "checkpoint", "job_config.loader"]
    banned += [f"models.{family}" for family in FAMILIES]
    return any(module == b or module.startswith(b + ".") for b in banned)


def test_the_rule_sees_every_form_of_import(tmp_path):
    assert FAMILIES and "llama3" in FAMILIES
    source = tmp_path / "example.py"
    source.write_text(
        "import train\nfrom job_config import loader\nimport training_data\n"
        "def f():\n    from models.qwen3_moe.model import MoE\n"
        "from job_config.problems import Problems\nfrom models.attention import attend\n"
    )
    bad = sorted(m for m in imported_modules(source) if forbidden(m))
    assert bad == ["job_config.loader", "models.qwen3_moe.model", "models.qwen3_moe.model.MoE",
                   "train"]  # fmt: skip


def test_parallelisms_import_no_loader_family_entry_script_or_trainer():
    files = sorted((ROOT / "parallelisms").rglob("*.py"))
    assert files
    bad = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in files
        for module in imported_modules(path)
        if forbidden(module)
    }
    assert not bad, sorted(bad)
