"""Every relative link and every file path named in README.md and docs/*.md points at a file
or folder that exists, so a moved test, script or benchmark cannot leave a stale reference.

Paths count in prose and in code blocks with a language (commands); a code block without one
is program output or a tree drawing, whose paths are not relative to the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a/b.py, scripts/x.sh, benchmarks/f/bench.md: at least one folder, a known file suffix, and
# not part of a longer token (a URL, an absolute path, a <placeholder>/ or {brace}/ path)
FILE_PATH = re.compile(
    r"(?<![\w./<>{}-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|md|toml|json|slurm|txt))(?![\w/])"
)


def _checked_text(page: Path) -> str:
    """The page without the contents of fenced blocks that have no language."""
    kept, fence = [], None  # fence: the open block's language ("" for none)
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence != "":
            kept.append(line)
    return "\n".join(kept)


def _missing(page: Path) -> list[str]:
    text = _checked_text(page)
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(f"link {target}")
    for path in FILE_PATH.findall(re.sub(r"\]\([^)\s]+\)", "]", text)):  # links: done
        if not ((ROOT / path).exists() or (page.parent / path).exists()):
            missing.append(f"path {path}")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_paths_exist(page):
    assert _missing(page) == [], f"{page.relative_to(ROOT)} names files that do not exist"


def test_a_stale_path_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See [the tests](missing/test_x.py) and `tests/test_estimate.py`.\n")
    assert _missing(page) == ["link missing/test_x.py", "path tests/test_estimate.py"]
