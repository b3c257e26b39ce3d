"""bench.py --render re-tabulates a folder's bench.json and keeps the hand-written `## Notes`
section of its bench.md (results measured beside the table)."""

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p.parent for p in (ROOT / "benchmarks").glob("*/bench.json"))


def _report(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # bench_report imports bench_rows
    import bench_report

    return bench_report


def test_notes_added_to_a_table_survive_a_rerender(tmp_path, monkeypatch):
    report = _report(monkeypatch)
    folder = tmp_path / "moe"
    folder.mkdir()
    shutil.copy(ROOT / "benchmarks" / "cpu_moe_ep2" / "bench.json", folder)
    payload = json.loads((folder / "bench.json").read_text())
    report.render(payload, folder)
    table = (folder / "bench.md").read_text()
    assert report.kept_notes(folder) == ""

    notes = "## Notes\n\n- a profile of one step: 71% in aten::mm\n"
    (folder / "bench.md").write_text(table + "\n" + notes)
    assert report.kept_notes(folder) == notes
    report.render(payload, folder, report.kept_notes(folder))
    assert (folder / "bench.md").read_text() == table + "\n" + notes


@pytest.mark.parametrize("source", FOLDERS, ids=lambda p: p.name)
def test_rerendering_a_benchmark_folder_gives_back_its_files(source, tmp_path, monkeypatch):
    report = _report(monkeypatch)
    folder = tmp_path / source.name
    shutil.copytree(source, folder)
    payload = json.loads((folder / "bench.json").read_text())
    report.render(payload, folder, report.kept_notes(folder))
    for name in ("bench.md", "bench.json"):
        assert (folder / name).read_text() == (source / name).read_text()
