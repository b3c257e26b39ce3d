"""bench.py --render re-tabulates a folder's bench.json and keeps the hand-written `## Notes`
section of its bench.md (results measured beside the table); a folder without notes gets back
exactly the file it had."""

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # bench_report imports bench_rows
    import bench_report

    return bench_report


def test_rerender_keeps_the_notes_and_the_table(tmp_path, monkeypatch):
    report = _report(monkeypatch)
    folder = tmp_path / "cpu_moe_ep2"
    shutil.copytree(ROOT / "benchmarks" / "cpu_moe_ep2", folder)
    table = (folder / "bench.md").read_text()
    notes = "## Notes\n\n- a profile of one step: 71% in aten::mm\n"
    (folder / "bench.md").write_text(table + "\n" + notes)
    assert report.kept_notes(folder) == notes

    payload = json.loads((folder / "bench.json").read_text())
    report.render(payload, folder, report.kept_notes(folder))
    assert (folder / "bench.md").read_text() == table + "\n" + notes


def test_rerender_without_notes_writes_the_same_file(tmp_path, monkeypatch):
    report = _report(monkeypatch)
    folder = tmp_path / "cpu_m50_dp2"
    shutil.copytree(ROOT / "benchmarks" / "cpu_m50_dp2", folder)
    before = (folder / "bench.md").read_text()
    assert report.kept_notes(folder) == ""

    report.render(json.loads((folder / "bench.json").read_text()), folder)
    assert (folder / "bench.md").read_text() == before
