"""The mutation check's catalogue follows the code: every planted bug's text occurs exactly once
in its file, and every test it names exists. The mutation check itself runs after the suite in
CI; this catches a catalogue that drifted from the code in seconds, before that."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _catalogue():
    path = ROOT / "tests" / "mutation" / "catalogue.py"
    spec = importlib.util.spec_from_file_location("mutation_catalogue", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_catalogue"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module.MUTANTS


MUTANTS = _catalogue()


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_text_occurs_once_and_its_tests_exist(mutant):
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, (
        f"{mutant.name}: its text occurs {text.count(mutant.old)} times in {mutant.path}; "
        "update tests/mutation/catalogue.py to follow the code"
    )
    assert mutant.new != mutant.old
    assert mutant.tests, f"{mutant.name} names no test that must catch it"
    for node in mutant.tests:
        path, _, rest = node.partition("::")
        test_file = ROOT / path
        assert test_file.is_file(), f"{mutant.name}: no test file {path}"
        function = re.split(r"[\[:]", rest)[0] if rest else ""
        if function:
            assert re.search(rf"^def {function}\(", test_file.read_text(), re.M), (
                f"{mutant.name}: no test function {function} in {path}"
            )
