"""tests/golden/record.py shows what would change and writes only with ``--accept``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.golden.record import diff, main

OLD = '{\n  "a": {\n    "samples": [\n      ["a", {"gpu": "0"}, 1.0],\n      ["a", {}, 2.0]\n'
NEW = OLD.replace("1.0", "1.5")


def test_the_diff_shows_only_changed_lines_and_counts_them() -> None:
    assert diff(OLD, OLD, "x.json") == []
    assert diff(OLD, NEW, "x.json") == [
        "--- x.json (recorded)",
        "+++ x.json (served now)",
        '-      ["a", {"gpu": "0"}, 1.0],',
        '+      ["a", {"gpu": "0"}, 1.5],',
        "x.json: 1 line(s) removed, 1 added",
    ]


def test_a_long_diff_is_cut_with_a_count_of_the_rest() -> None:
    old = "".join(f"{i}\n" for i in range(100))
    lines = diff(old, old.replace("\n", " \n"), "x.json", limit=10)
    assert len(lines) == 2 + 10 + 1
    assert lines[-1] == "x.json: 100 line(s) removed, 100 added; 190 more not shown"
    assert diff(None, "{}\n", "x.json")[:3] == [
        "--- x.json (no file yet)",
        "+++ x.json (served now)",
        "+{}",
    ]


def test_bad_arguments_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["no-such-scenario", "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "cannot read scenario 'no-such-scenario'" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.slow  # runs a scenario three times (~1 s each)
def test_a_difference_is_written_only_with_accept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "single-gpu.json"
    assert main(["single-gpu", "--out", str(tmp_path)]) == 1
    assert f"--- {target} (no file yet)" in capsys.readouterr().out
    assert not target.exists()  # nothing written

    assert main(["single-gpu", "--out", str(tmp_path), "--accept"]) == 0
    assert f"wrote {target}" in capsys.readouterr().err
    recorded = target.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files

    stale = recorded.replace('"gpu_exporter_build_info"', '"gpu_exporter_build_inf0"', 1)
    target.write_text(stale)
    assert main(["single-gpu", "--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert '-  "gpu_exporter_build_inf0": {' in out and '+  "gpu_exporter_build_info": {' in out
    assert "run again with --accept" in err
    assert target.read_text() == stale  # nothing written
