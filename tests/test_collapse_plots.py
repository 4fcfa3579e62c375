"""Collapse figures, the template-collapse health rule, `rldyn plot --paper` with MI, and the sweep finding."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rldynamics import metric_names as names
from rldynamics.plots.cli import plot_command, report_command
from rldynamics.plots.collapse import check_template_collapse, spearman, spearman_interval
from rldynamics.sweep.report import write_summary
from rldynamics.sweep.runs import write_status
from rldynamics.tracking.run_dir import RunWriter

FT = "collapse_first_turn_sample"


def _rows(mi: list[float], entropy: list[float], retrieval: list[float] | None = None) -> list[dict]:
    """Metrics rows diagnosed at steps 1, 5, 10, ... with the given MI, entropy and retrieval above chance."""
    steps = [1] + [5 * k for k in range(1, len(mi))]
    retrieval = retrieval or [0.3] * len(mi)
    return [{"step": s, f"{FT}/mi_estimate": m, f"{FT}/conditional_entropy_est": h,
             f"{FT}/reasoning_entropy_est": h + m, f"{FT}/retrieval_above_chance": r,
             f"{FT}/mi_estimate/ci_low": m - 0.01, f"{FT}/mi_estimate/ci_high": m + 0.01}
            for s, m, h, r in zip(steps, mi, entropy, retrieval, strict=True)]


def test_template_collapse_rule_names_the_step_range():
    flags = check_template_collapse(_rows([0.2, 0.3, 0.2, 0.1, 0.12], [1.0, 1.0, 1.05, 0.98, 1.0]))
    assert [f.check for f in flags] == ["template_collapse_mi_estimate"]
    assert flags[0].numbers["steps"] == "5–15" and "between steps 5 and 15" in flags[0].title
    # entropy falling with the MI is low-entropy collapse, not template collapse; a rising MI is healthy
    assert check_template_collapse(_rows([0.2, 0.3, 0.2, 0.1], [1.0, 1.0, 0.6, 0.4])) == []
    assert check_template_collapse(_rows([0.1, 0.2, 0.3], [1.0, 1.0, 1.0])) == []
    # retrieval above chance falling alone is flagged too
    only = check_template_collapse(_rows([0.2, 0.2, 0.2], [1.0, 1.0, 1.0], retrieval=[0.5, 0.4, 0.1]))
    assert [f.check for f in only] == ["template_collapse_retrieval_above_chance"]
    assert check_template_collapse([{"step": 1, names.ENTROPY: 1.0}]) == []


def test_spearman_by_hand_and_its_interval_brackets_it():
    # ranks of y with a tie: [1, 2, 3.5, 5, 3.5]; Pearson with [1..5]: 8 / sqrt(10 * 9.5)
    assert spearman(np.arange(5.0), np.array([5.0, 6, 7, 8, 7])) == pytest.approx(8 / math.sqrt(95))
    rng = np.random.default_rng(0)
    x = rng.normal(size=12)
    y = x + rng.normal(size=12)
    low, high = spearman_interval(x, y, resamples=500)
    assert low < spearman(x, y) < high
    assert math.isnan(spearman(x[:2], y[:2])) and math.isnan(spearman(x, np.ones(12)))


def _run(path, rows: list[dict], success: list[tuple[int, float]]):
    path.mkdir(parents=True)
    writer = RunWriter(path)
    by_step = {r["step"]: dict(r) for r in rows}
    for step, value in success:
        by_step.setdefault(step, {"step": step})[names.val_success("sokoban")] = value
    for step in sorted(by_step):
        row = {k: v for k, v in by_step[step].items() if k != "step"}
        row.update({names.STEP_TIME: 1.0} if step else {names.VAL_TIME: 1.0})
        writer.log(step, row)
    return path


def test_figures_report_and_paper_from_collapse_metrics(tmp_path, capsys):
    a = _run(tmp_path / "a", _rows([0.2, 0.3, 0.1], [1.0, 1.0, 1.0]), [(0, 0.1), (10, 0.2)])
    b = _run(tmp_path / "b", _rows([0.2, 0.3, 0.4], [1.0, 0.8, 0.6]), [(0, 0.1), (10, 0.3)])
    assert plot_command(a, out=tmp_path / "plots") == 0
    assert (tmp_path / "plots" / "collapse_mi_entropy.png").stat().st_size > 0
    assert (tmp_path / "plots" / "collapse_regimes.png").stat().st_size > 0
    assert report_command(a) == 0
    page = (a / "report.html").read_text()
    assert 'id="collapse"' in page and "template collapse: MI estimate fell from 0.3 to 0.1" in page
    assert plot_command([a, b], paper=True, out=tmp_path / "paper") == 0  # no gradient analysis: MI figure only
    assert (tmp_path / "paper" / "paper_mi_success.png").stat().st_size > 0


def test_sweep_summary_shows_mi_beside_success_and_the_rank_correlations(tmp_path):
    out = tmp_path / "sw"
    for i, (label, mi, h, success) in enumerate([("p0", 0.1, 1.0, 0.1), ("p0", 0.2, 0.5, 0.2),
                                                  ("p1", 0.3, 0.9, 0.3), ("p1", 0.4, 0.6, 0.4)]):
        path = _run(out / label / f"seed{i}", _rows([mi, mi], [h, h]), [(0, 0.0), (5, success)])
        write_status(path, sweep="custom", keys=["algo.entropy_coef"], point=label, value=label, index=int(label[1]),
                     state="completed", returncode=0)
    write_summary(out)
    md = (out / "summary.md").read_text()
    assert "| final MI | final H(Z\\|X) |" in md
    assert "- final MI estimate: 1 [" in md and "(4 runs)" in md
    assert "- final conditional entropy H(Z|X): -0.4 [" in md
    header, first = (out / "summary.csv").read_text().splitlines()[:2]
    row = dict(zip(header.split(","), first.split(","), strict=False))
    assert row["final_mi_mean"] == "0.15"
