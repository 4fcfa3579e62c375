"""What the console says around a run: a legend of the step line's abbreviations first, and at the end one result
(validation start -> end with standard errors, the health verdict, where the report is) instead of a list of figure
files; the run directory's lock file is gone after a clean end."""

from __future__ import annotations

from pathlib import Path

from rldynamics.cli import main
from rldynamics.tracking.console import LEGEND, SUMMARY_KEYS
from rldynamics.tracking.run_dir import RunLock


def test_a_run_ends_with_its_result_and_names_no_figure_files(fast_overrides, capsys):
    keys = [*fast_overrides, "log.name=end", "log.report=true", "log.progress=true", "train.steps=2",
            "val.every=2", "val.env_groups=8", "val.held_out=0.3", "env.name=countdown"]
    assert main(["train", "--preset", "countdown-tiny", *keys]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(LEGEND in line for line in out)
    result = [line for line in out if line.startswith("result: ")]
    assert len(result) == 1 and "validation success" in result[0] and " ± " in result[0]
    assert "at step 0 ->" in result[0] and "at step 2 (" in result[0]
    assert any(line.startswith("health: ") for line in out)
    run = Path(fast_overrides[-1].split("=", 1)[1]) / "end"
    assert f"report: {run / 'report.html'}" in out[-3:] and (run / "report.html").is_file()
    assert not any(line.strip().endswith(".png") for line in out)  # no list of figure files
    assert not (run / ".lock").exists()


def test_the_legend_explains_every_label_of_the_step_line():
    for label, _, meaning in SUMMARY_KEYS:
        assert f"{label} = {meaning}" in LEGEND


def test_a_clean_release_removes_the_lock_file_and_a_later_lock_works(tmp_path):
    with RunLock(tmp_path / "run"):
        assert (tmp_path / "run" / ".lock").is_file()
    assert not (tmp_path / "run" / ".lock").exists()
    with RunLock(tmp_path / "run") as again:
        assert again.stale is None and (tmp_path / "run" / ".lock").is_file()


def test_a_run_without_a_report_still_ends_with_its_result(fast_overrides, capsys):
    keys = [*fast_overrides, "log.name=plain", "log.progress=true", "train.steps=1", "val.every=1"]
    assert main(["train", *keys]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("result: validation success") for line in out)
    assert not any(line.startswith("report: ") for line in out)
