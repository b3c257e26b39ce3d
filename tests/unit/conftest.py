"""Fixtures of the unit tests that build real runs from a config (`test_option_effects.py`,
`test_resume_counters.py`): the files of `tests/option_probes.py` and a private token cache."""

from __future__ import annotations

import pytest
from option_probes import write_option_files


@pytest.fixture(scope="module")
def option_files(tmp_path_factory) -> dict[str, str]:
    """The tokenizers, corpora and importable module every option probe reads."""
    return write_option_files(tmp_path_factory.mktemp("option_files"))


@pytest.fixture
def private_token_cache(tmp_path_factory, monkeypatch) -> None:
    """The loaders' token caches go to a temporary folder, not the repository's `.cache`."""
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "token_cache"))
