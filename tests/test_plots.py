"""Plots and report from synthetic run directories written with the real RunWriter (no training, no torch)."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.image import imread
from safetensors.numpy import save_file

from rldynamics import metric_names as names
from rldynamics.plots import health
from rldynamics.plots.analysis import fig_grad_norms, fig_losses, fig_normed_grads, fig_summary, step_data
from rldynamics.plots.cli import plot_command, report_command
from rldynamics.plots.curves import fig_reg_share, fig_training_curves, trailing_mean
from rldynamics.plots.data import analysis_steps, load_run
from rldynamics.plots.report import build_report
from rldynamics.tracking.environment import describe, record_start
from rldynamics.tracking.run_dir import RunWriter

STEP_FILES = ["gradient_analysis_summary_step_{}.png", "gradient_analysis_plots_step_{}.png",
              "gradient_analysis_loss_plots_step_{}.png", "gradient_analysis_reward_std_step_{}.png",
              "gradient_analysis_normed_grads_step_{}.png", "gradient_analysis_metrics_step_{}.json",
              "gradient_analysis_bucket_rv_table_step_{}.csv"]
BUCKET_RVS = {"bucket_1": [0.0, 0.0], "bucket_2": [0.0, 0.3], "bucket_3": [0.8, 1.1], "bucket_4": [1.9, 2.5, 3.0]}


def _bucket_metrics(step: int, rng: np.random.Generator, kl: bool = True) -> dict[str, float]:
    """RAGEN-named analysis metrics for 4 buckets (+ all); bucket_1 has zero RV hence zero task gradient."""
    m = {}
    for b, rvs in {**BUCKET_RVS, names.ALL: sum(BUCKET_RVS.values(), [])}.items():
        rv = float(np.mean(rvs))
        task, raw_ent, raw_kl = 0.5 * rv, 2.0 + rng.random(), 0.3 + 0.1 * step
        count = 8.0 * len(rvs)
        vals = {"task": task, "entropy": 1e-3 * raw_ent, "raw/entropy": raw_ent, "reward_std_mean": rv,
                "reward_std_min": min(rvs), "reward_std_max": max(rvs), "sample_count": count,
                "group_rv_count": float(len(rvs)), "sample_pct": count / 72, names.loss("policy"): -0.01 * rv,
                names.loss("entropy"): -1e-3 * raw_ent, names.LOSS_TOTAL: -0.01 * rv - 1e-3 * raw_ent,
                "per_sample/task": task / count, "per_token/task": task / (count * 30),
                "per_sample/entropy": 1e-3 * raw_ent / count, "per_token/entropy": 1e-3 * raw_ent / (count * 30),
                "cos/task_entropy": 0.1 * rng.standard_normal(), "regularizer": 1e-3 * raw_ent,
                "reg_share": 1e-3 * raw_ent / (task + 1e-3 * raw_ent)}
        if kl:
            vals.update({"kl": 1e-3 * raw_kl, "raw/kl": raw_kl, names.loss("kl"): 1e-4,
                         "per_sample/kl": 1e-3 * raw_kl / count, "per_token/kl": 1e-3 * raw_kl / (count * 30),
                         "cos/task_kl": -0.05, "cos/entropy_kl": 0.2})
        m.update({names.bucket_metric(names.GRAD_NORM, b, k): v for k, v in vals.items()})
    return m


def _write_analysis(writer: RunWriter, step: int, rng: np.random.Generator) -> None:
    d = writer.analysis_dir(step)
    with open(d / "groups.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prefix", "bucket", "group_id", "reward_std"])
        gid = 0
        for b, rvs in BUCKET_RVS.items():
            for rv in rvs:
                w.writerow([names.GRAD_NORM, b, gid, rv])
                gid += 1
        w.writerow([names.GRAD_NORM_PREFILTER, "bucket_1", 99, 0.0])  # other prefix: must not reach the CSV table
    base = rng.standard_normal(1024).astype(np.float32)
    sketches = {names.bucket_metric(names.GRAD_NORM, b, "task"):
                (base + k * rng.standard_normal(1024)).astype(np.float32) for k, b in enumerate([*BUCKET_RVS, names.ALL])}
    save_file({**sketches, names.bucket_metric(names.GRAD_NORM, "bucket_1", "entropy"): base},
              str(d / "sketches.safetensors"))
    (d / "metrics.json").write_text(json.dumps({names.filter_metric(names.GRAD_ANALYSIS, "uses_training_batch"): 1.0}))


def make_run(path: Path, *, steps: int = 6, analysis: tuple[int, ...] = (1, 4), healthy: bool = True,
             name: str | None = None, kl: bool = True) -> Path:
    """A synthetic run directory; `healthy=False` plants a NaN grad norm, clipfrac 0.6, falling reward, early stop."""
    writer = RunWriter(path)
    cfg = {"env": {"name": "sokoban"}, "train": {"env_groups": 8}, "log": {"name": name or path.name}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    rng = np.random.default_rng(0)
    writer.log(0, {names.val_success("sokoban"): 0.1, names.VAL_TIME: 1.0})
    for s in range(1, steps + 1):
        m = {names.SCORE_MEAN: (0.2 * s if healthy else 2.0 - 0.3 * s), names.ENTROPY: 1.0 - 0.02 * s,
             names.STEP_TIME: 2.0,
             names.ACTOR_GRAD_NORM: 0.3 + 0.01 * s, names.PG_CLIPFRAC: 0.2 if healthy else 0.6,
             names.PG_LOSS: 0.01 * (-1) ** s, names.KL_LOSS: 0.001 * s,
             names.SKIPPED_STEPS: 0.0, names.FILTER_KEPT_RATIO: 0.75, names.FILTER_KEPT_COUNT: 6.0,
             names.FILTER_ZERO_COUNT: 1.0, names.IN_GROUP_REWARD_STD: 1.0, names.RESPONSE_LENGTH_MEAN: 30.0 + s,
             names.env_metric("sokoban", names.SUCCESS): 0.1 + 0.05 * s,
             names.env_metric("sokoban", "response_length"): 7.0}
        if not healthy and s == 3:
            m[names.ACTOR_GRAD_NORM] = math.nan
        if not healthy and s == steps:
            m[names.early_stopped("reward_variance_collapse")] = 1.0
        if s % 2 == 0:
            m[names.val_success("sokoban")] = 0.1 + 0.04 * s
        if s in analysis:
            m.update(_bucket_metrics(s, rng, kl=kl))
            _write_analysis(writer, s, rng)
        writer.log(s, m)
    writer.close()
    return path


def _assert_png(path: Path) -> None:
    img = imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, path
    assert float(img[..., :3].std()) > 0.01, f"{path.name} looks blank"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "synthetic")


@pytest.fixture(scope="module")
def plotted(run, tmp_path_factory) -> Path:
    """`rldyn plot` output of the synthetic run (rendered once for the module)."""
    out = tmp_path_factory.mktemp("plots")
    assert plot_command(run, None, False, out, False, None) == 0
    return out


def test_analysis_steps_need_nonzero_bucket_values(run):
    assert analysis_steps(load_run(run)) == [1, 4]
    assert load_run(run).row(1)["grad_analysis/uses_training_batch"] == 1.0  # merged from analysis metrics.json


def test_plot_writes_every_file(plotted):
    out = plotted
    for step in (1, 4):
        for pattern in STEP_FILES:
            assert (out / pattern.format(step)).exists(), pattern.format(step)
        assert (out / f"analysis_sketch_cosines_step_{step}.png").exists()
    for name in ("training_curves.png", "analysis_cosines.png", "analysis_reg_share.png"):
        assert (out / name).exists(), name
    for png in out.glob("*.png"):
        _assert_png(png)


def test_plot_metrics_json_and_rv_table(plotted):
    row = json.loads((plotted / "gradient_analysis_metrics_step_4.json").read_text())
    assert row["step"] == 4 and row["grad_norm/bucket_3/task"] == pytest.approx(0.5 * 0.95)
    assert list(row) == sorted(row)
    assert names.SCORE_MEAN in row and names.bucket_metric(names.GRAD_NORM, names.ALL, "raw/kl") in row
    with open(plotted / "gradient_analysis_bucket_rv_table_step_1.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["bucket", "reward_std"]
    expected = [(b, v) for b, vs in BUCKET_RVS.items() for v in vs]
    assert [(b, float(v)) for b, v in rows[1:]] == expected


def test_plot_list_steps_and_errors(run, tmp_path, capsys):
    assert plot_command(run, None, True, None, False, None) == 0
    assert capsys.readouterr().out.strip() == "1 4"
    assert plot_command(run, [2], False, tmp_path, False, None) == 2
    err = capsys.readouterr().err
    assert "step(s) 2" in err and "available: 1, 4" in err
    assert plot_command(tmp_path / "nope", None, False, None, False, None) == 2
    assert "nope" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_step_filter_single_step_missing_kl_and_odd_values(tmp_path):
    path = make_run(tmp_path / "nokl", steps=3, analysis=(1, 3), kl=False)
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    rows[-1].update({"grad_norm/bucket_2/task": math.nan, "grad_norm/bucket_3/task": math.inf})
    del rows[-1]["grad_norm/bucket_4/loss/policy"]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("groups.csv", "sketches.safetensors"):
        (path / "analysis" / "step_3" / name).unlink()
    assert plot_command(path, [3], False, None, False, None) == 0
    for pattern in STEP_FILES[:5]:
        _assert_png(path / "plots" / pattern.format(3))
        assert not (path / "plots" / pattern.format(1)).exists()
    assert not (path / "plots" / "analysis_sketch_cosines_step_3.png").exists()
    assert (path / "plots" / "gradient_analysis_bucket_rv_table_step_3.csv").read_text().strip() == "bucket,reward_std"
    assert math.isinf(json.loads((path / "plots" / "gradient_analysis_metrics_step_3.json").read_text())[
        "grad_norm/bucket_3/task"])


def test_empty_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_command(tmp_path, None, False, None, False, None) == 0
    assert "No gradient-analysis steps found." in capsys.readouterr().out
    assert report_command(tmp_path, None) == 0
    assert "nothing to check" in (tmp_path / "report.html").read_text()


def test_run_without_analysis_and_odd_values(tmp_path, capsys):
    path = make_run(tmp_path / "plain", steps=1, analysis=())
    with open(path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "critic/score/mean": NaN, "actor/grad_norm": Infinity}\n{"step": 3, "actor/ent')
    assert plot_command(path, None, True, None, False, None) == 0
    captured = capsys.readouterr()
    assert "No gradient-analysis steps found." in captured.out and "line 4" in captured.err
    assert plot_command(path, None, False, None, False, None) == 0
    _assert_png(path / "plots" / "training_curves.png")
    assert not list((path / "plots").glob("gradient_analysis_*"))
    assert plot_command(path, [1], False, None, False, None) == 2
    assert report_command(path, None) == 0
    assert "No gradient-analysis steps" in (path / "report.html").read_text()


def test_paper_grid_from_two_runs(run, tmp_path, capsys):
    other = make_run(tmp_path / "later", steps=12, analysis=(10,))
    out = tmp_path / "paper"
    assert plot_command([run, other], None, False, out, True, [1, 4, 10]) == 0
    _assert_png(out / "paper_grid.png")
    assert plot_command([run, other], None, False, out, True, [7]) == 2
    assert "step 7" in capsys.readouterr().err
    assert plot_command([run, other], None, False, None, False, None) == 2  # several dirs need --paper


def _rename_buckets(path: Path, shift: int) -> None:
    """Rename `bucket_k` to `bucket_{k + shift}` in metrics.jsonl and groups.csv (fixed_rv with empty low intervals)."""
    def rename(text: str) -> str:
        for k in sorted(range(1, 7), reverse=True):
            text = text.replace(f"bucket_{k}", f"bucket_{k + shift}")
        return text
    for file in [path / "metrics.jsonl", *path.glob("analysis/step_*/groups.csv")]:
        file.write_text(rename(file.read_text()))


def test_fixed_rv_buckets_are_labelled_by_interval(tmp_path):
    path = make_run(tmp_path / "fixed", steps=4, analysis=(4,))
    config = yaml.safe_load((path / "config.yaml").read_text())
    (path / "config.yaml").write_text(yaml.safe_dump({**config, "analysis": {"bucket_mode": "fixed_rv"}}))
    _rename_buckets(path, 2)  # intervals [0,1) and [1,2) were empty: the buckets are bucket_3..bucket_6
    run = load_run(path)
    sd = step_data(run, 4)
    assert sd.buckets == ["bucket_3", "bucket_4", "bucket_5", "bucket_6"]
    assert sd.labels == ["[2, 3)", "[3, 4)", "[4, 5)", "[5, ∞)"]
    assert plot_command(path, None, False, None, False, None) == 0
    _assert_png(path / "plots" / "gradient_analysis_plots_step_4.png")
    assert report_command(path, None) == 0
    text = (path / "report.html").read_text()
    assert "<th>[2, 3)</th>" in text and "<th>Q3</th>" not in text and "fixed intervals" in text
    quantile = step_data(load_run(make_run(tmp_path / "quantile", steps=1, analysis=(1,))), 1)
    assert quantile.labels == ["Q1", "Q2", "Q3", "Q4"]


def test_zero_gradients_nan_cosines_in_figures_report_and_health(tmp_path):
    """A probe of the initial model with k3 KL: zero KL gradient, NaN cosines (and a 0/0 reg_share) with flags."""
    path = make_run(tmp_path / "zero", steps=2, analysis=(1,))
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for b in ("all", "bucket_1", "bucket_2", "bucket_3", "bucket_4"):
        key = f"grad_norm/{b}"
        rows[1].update({f"{key}/raw/kl": 0.0, f"{key}/kl": 0.0, f"{key}/zero_grad/kl": 1.0,
                        f"{key}/zero_grad/task": float(b == "bucket_1"), f"{key}/zero_grad/entropy": 0.0,
                        f"{key}/cos/task_kl": math.nan, f"{key}/cos/entropy_kl": math.nan})
    rows[1].update({"grad_norm/bucket_1/task": 0.0, "grad_norm/bucket_1/cos/task_entropy": math.nan,
                    "grad_norm/bucket_1/regularizer": 0.0, "grad_norm/bucket_1/reg_share": math.nan})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = {f.check: f for f in health.health_checks(load_run(path).rows)}
    assert flags["zero_gradient_kl"].severity == "note" and flags["zero_gradient_kl"].numbers["steps"] == "1"
    assert "reference" in flags["zero_gradient_kl"].detail
    assert flags["zero_gradient_task"].numbers["buckets"] == "bucket_1"
    assert plot_command(path, None, False, None, False, None) == 0
    for name in ("gradient_analysis_plots_step_1.png", "analysis_cosines.png", "analysis_reg_share.png"):
        _assert_png(path / "plots" / name)
    assert report_command(path, None) == 0
    text = (path / "report.html").read_text()
    table = text[text.index("<summary>bucket metrics"):]
    cos_kl = table[table.index(">cos/task_kl<"):].split("</tr>")[0]
    reg_share = table[table.index(">reg_share<"):].split("</tr>")[0]
    assert cos_kl.count("undef.") == 5 and "n/a" not in cos_kl  # every bucket: the KL gradient is zero
    assert reg_share.count("undef.") == 1 and "n/a" not in reg_share  # bucket_1: 0/0
    assert "the kl gradient is exactly zero" in text


def test_report_embeds_figures_and_healthy_run_has_no_issues(run, tmp_path):
    out = tmp_path / "r" / "report.html"
    assert report_command(run, out) == 0
    text = out.read_text()
    assert text.count("data:image/png;base64,") >= 1 + 2 + 2 * 6
    assert "No issues found" in text and "Step 4" in text and "<details" in text and "sokoban" in text
    assert "http://" not in text and "https://" not in text and "<script" not in text


def test_report_flags_unhealthy_run(tmp_path):
    path = make_run(tmp_path / "sick", steps=8, analysis=(), healthy=False)
    flags = {f.check: f for f in health.health_checks(load_run(path).rows, load_run(path).config)}
    assert flags["grad_norm_nonfinite"].severity == "error" and "3" in flags["grad_norm_nonfinite"].numbers["steps"]
    assert flags["clipfrac_high"].numbers["mean over last steps"] == "60.0%"
    assert float(flags["reward_not_improving"].numbers["slope per step"]) == pytest.approx(-0.3)
    assert flags["early_stop"].numbers["reason"] == "reward_variance_collapse"
    assert report_command(path, None) == 0
    text = (path / "report.html").read_text()
    for title in ("non-finite actor/grad_norm", "clip fraction 60.0%", "rule of thumb", "not trending up",
                  "stopped early: reward_variance_collapse"):
        assert title in text, title
    assert "No issues found" not in text


def test_health_checks_on_rows():
    rows = [{"step": s, names.ACTOR_GRAD_NORM: 1.0, names.PG_LOSS: 0.01, names.SKIPPED_STEPS: 0.0} for s in range(10)]
    assert health.health_checks(rows) == []
    rows[8][names.ACTOR_GRAD_NORM] = 9.0
    rows[5][names.PG_LOSS] = -250.0
    rows[6][names.SKIPPED_STEPS] = 2.0
    rows[7].update({names.FILTER_ZERO_COUNT: 7.0, names.FILTER_KEPT_COUNT: 1.0, names.FILTER_KEPT_RATIO: 0.125})
    checks = {f.check: f for f in health.health_checks(rows)}
    assert set(checks) == {"grad_norm_spike", "loss_swings", "skipped_steps", "zero_variance_groups"}
    assert "step 8" in checks["grad_norm_spike"].numbers["worst"]
    assert "step 5" in checks["loss_swings"].numbers["largest |loss|"]
    assert checks["zero_variance_groups"].numbers["mean share (last steps)"] == "87.5%"


def test_report_module_imports_no_torch():
    code = ("import sys, rldynamics.plots.report, rldynamics.plots.cli; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_report_renders_in_headless_chromium(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "check_report.sh"
    if not script.exists():
        pytest.skip("scripts/check_report.sh missing")
    run = make_run(tmp_path / "shown", steps=4, analysis=(), healthy=False)
    shot = tmp_path / "shot.png"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the script's `python`: ours
    done = subprocess.run(["bash", str(script), str(run), str(shot)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": path})
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_png(shot)


def test_trailing_mean_by_hand():
    y = np.array([1.0, 3.0, 5.0, 7.0, 9.0])
    assert trailing_mean(y, 2).tolist() == [1.0, 2.0, 4.0, 6.0, 8.0]
    assert trailing_mean(y, 3).tolist() == [1.0, 2.0, 3.0, 5.0, 7.0]
    assert trailing_mean(y, 1).tolist() == y.tolist()


# ---------------------------------------------------------------- odd data: the figures are drawn, bad points marked


def _edit_rows(path: Path, edit) -> None:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))


def _huge_values(rows):
    for r in rows:
        for k in r:
            if k.startswith(("actor/", "grad_norm/")):
                r[k] = 1e308 if r["step"] % 2 else -1e308
    return rows


ODD = {
    "mathtext in names": lambda p: (
        (p / "config.yaml").write_text(yaml.safe_dump({"log": {"name": r"$\frac{a$ run $x^$"}, "env": {"name": "$"}})),
        _edit_rows(p, lambda rows: [{**r, "train/$x^_{$/success": 0.5} for r in rows])),
    "values of 1e308": lambda p: _edit_rows(p, _huge_values),
    "step Infinity, NaN, 1e300, true": lambda p: _edit_rows(p, lambda rows: [
        *rows, {"step": math.inf, names.ACTOR_GRAD_NORM: 1.0}, {"step": math.nan}, {"step": 1e300}, {"step": True}]),
    "corrupted sketches": lambda p: [f.write_bytes(f.read_bytes()[:99]) for f in p.glob("analysis/*/sketches.*")],
    "non-UTF-8 bytes in groups.csv": lambda p: [f.write_bytes(f.read_bytes() + b"grad_norm,bucket_\xff,7,\xfe\n")
                                                for f in p.glob("analysis/*/groups.csv")],
    "odd rewards.jsonl": lambda p: (p / "rewards.jsonl").write_bytes(
        b'{"step": 1, "response_chars": 5, "response_tokens": 2}\n{"step": Infinity, "response_chars": 1e308, '
        b'"response_tokens": 1}\n{"step": 2, "response_chars": "x"}\n'),
    "non-UTF-8 bytes in metrics.jsonl": lambda p: open(p / "metrics.jsonl", "ab").write(b'{"step": 9, "x": "\xff"}\n'),
    "non-UTF-8 bytes in config.yaml": lambda p: (p / "config.yaml").write_bytes(b"log:\n  name: \xff\n"),
    "non-UTF-8 analysis metrics.json": lambda p: [f.write_bytes(b'{"grad_norm/bucket_1/task": Infinity, "\xff": 1}')
                                                  for f in p.glob("analysis/*/metrics.json")],
}


@pytest.mark.parametrize("cases", [[c for c in ODD if c != "non-UTF-8 bytes in config.yaml"],  # bad bytes last
                                   ["non-UTF-8 bytes in config.yaml"]])
def test_odd_data_is_drawn_not_crashed_on(tmp_path, cases):
    """Every kind of odd data at once (each of them crashed `rldyn plot` or `rldyn report` before)."""
    path = make_run(tmp_path / "odd", healthy=False)
    for case in cases:
        ODD[case](path)
    assert plot_command(path) == 0
    assert report_command(path) == 0
    _assert_png(path / "plots" / "training_curves.png")
    for step in (1, 4):
        _assert_png(path / "plots" / f"gradient_analysis_summary_step_{step}.png")
    assert (path / "report.html").stat().st_size > 10_000


def _add_intervals_and_group_norms(path: Path, step: int) -> None:
    """Give a synthetic run's analysis step bootstrap intervals and per-group norms (as `analysis.per_group` does)."""
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if row["step"] == step:
            for key in [k for k in row if k.startswith("grad_norm/bucket_") and k.split("/", 2)[2] in
                        ("task", "entropy", "kl", "regularizer", "reg_share")]:
                row[f"{key}/ci_low"], row[f"{key}/ci_high"] = 0.8 * row[key], min(1.2 * row[key], 1.0 + 0.2 *
                                                                                   row[key])
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(path / "analysis" / f"step_{step}" / "groups.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prefix", "bucket", "group_id", "reward_std", "seed", "share", "task", "regularizer"])
        for gid, (bucket, rv) in enumerate((b, rv) for b, rvs in BUCKET_RVS.items() for rv in rvs):
            w.writerow(["grad_norm", bucket, gid, rv, 100 + gid, 0.5, 0.4 * math.sqrt(rv), 0.002 + 1e-4 * gid])


def test_figures_do_not_mislead(tmp_path):

    from rldynamics.plots.analysis import fig_groups, fig_summary, fit_slope
    from rldynamics.plots.curves import fig_reg_share

    path = make_run(tmp_path / "ci", steps=4, analysis=(1, 4))
    _add_intervals_and_group_norms(path, 4)
    sd = step_data(load_run(path), 4)
    assert sd.zero_rv.tolist() == [True, False, False, False]  # bucket_1 holds only RV = 0 groups
    fig = fig_summary(sd)
    _, task_ax, reg_ax = fig.axes[:3]
    for ax in (task_ax, reg_ax):
        assert ax.get_xscale() == "log" and ax.get_ylim()[0] == 0.0  # RV on log x; norms from 0
        assert not any(len(line.get_xdata()) > 1 and line.get_linestyle() != "None" for line in ax.lines
                       if line.get_linestyle() != ":"), "bucket points must not be joined"
    points = task_ax.lines[0].get_xdata()
    divider = next(line.get_xdata()[0] for line in task_ax.lines if line.get_linestyle() == ":")
    assert points[0] < divider < min(points[1:])  # the zero-RV bucket sits apart, left of the divider
    assert task_ax.collections, "whiskers from the logged intervals"
    share = fig_reg_share(load_run(path))
    assert share.axes[0].get_yscale() == "log"
    assert share.axes[0].get_xticks().tolist() == [1, 4]  # ticks at the analysis steps, not at the side-by-side offsets
    groups = fig_groups(sd)
    assert groups is not None and all(ax.get_xscale() == "log" for ax in groups.axes)
    assert "slope 0.5" in groups.axes[0].get_title()  # task = 0.4·√RV exactly
    assert "slope ≤ 1 on this axis" in groups.get_suptitle()  # the bound against σ, not against the variance
    assert fit_slope(np.array([1.0, 4.0, 9.0]), np.array([2.0, 4.0, 6.0]))[0] == pytest.approx(0.5)
    assert fig_groups(step_data(load_run(path), 1)) is None  # no per-group norms at step 1
    assert plot_command(path, None, False, None, False, None) == 0
    _assert_png(path / "plots" / "gradient_analysis_groups_step_4.png")


def test_bar_axis_scale_follows_the_bars_not_the_whiskers():
    # KL norms 2.4e-4..7.5e-4 (one bucket's interval reaching down to 1e-5): bars on a linear axis from 0, not
    # a log axis on which 2.4e-4 and 7.5e-4 look nearly equal
    from rldynamics.plots.analysis import bars
    from rldynamics.plots.figure import new_figure

    ax = new_figure(4, 3).add_subplot()
    values = np.array([3.7e-4, 2.4e-4, 7.5e-4])
    bars(ax, ["Q1", "Q2", "Q3"], values, "r", ci=(np.array([2e-4, 1e-4, 1e-5]), np.array([5e-4, 4e-4, 1.5e-3])))
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] <= 0.0 and ax.get_ylim()[1] >= 1.5e-3
    ax = new_figure(4, 3).add_subplot()
    bars(ax, ["Q1", "Q2"], np.array([1e-6, 1.0]), "r")  # bars themselves over six decades: log
    assert ax.get_yscale() == "log"


def test_png_bytes_draws_once_and_gives_savefigs_bytes_at_each_dpi(monkeypatch):
    """A figure laid out by its engine and drawn once is the figure `savefig` lays out and draws twice, byte for byte,
    at the files' and the report's dpi alike; the figure keeps its layout engine and dpi, so it can be saved again."""
    import io

    from matplotlib.figure import Figure

    from rldynamics.plots.figure import DPI, PNG_METADATA, REPORT_DPI, literal_text, new_figure, png_bytes

    def build():
        fig = new_figure(7, 4, facecolor="0.9")  # a PNG's background is white all the same
        left, right = fig.subplots(1, 2)
        left.plot([1, 2, 3], [1e-4, 0.3, 2.0], marker="o", label="a long legend entry")
        left.set_yscale("log")
        left.set_title("a title that needs room")
        left.legend()
        right.bar(["Q1", "Q2", "Q3"], [0.2, 0.5, 0.1])
        right.set_ylabel("a y label")
        fig.suptitle("the figure's title")
        return fig

    def savefig_bytes(fig, dpi):
        literal_text(fig)
        buf = io.BytesIO()
        fig.savefig(buf, dpi=dpi, format="png", facecolor="white", metadata=PNG_METADATA)
        return buf.getvalue()

    draws = []
    draw = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, renderer: draws.append(1) or draw(self, renderer))
    fig = build()
    figure_dpi = fig.dpi
    ours = [png_bytes(fig, dpi) for dpi in (DPI, REPORT_DPI, DPI)]
    assert len(draws) == 3  # one draw a PNG
    assert figure_dpi not in (DPI, REPORT_DPI)  # so the dpi below is the figure's own, restored
    assert fig.dpi == figure_dpi and fig.get_layout_engine() is not None and fig.get_facecolor() == (0.9, 0.9, 0.9, 1)
    expected = [savefig_bytes(build(), dpi) for dpi in (DPI, REPORT_DPI)]
    assert len(draws) == 3 + 2 * 2  # savefig lays out and draws: two draws a PNG
    assert ours == [expected[0], expected[1], expected[0]]


def test_paper_overlays_two_runs_at_the_same_steps(tmp_path):
    from matplotlib.colors import to_hex

    from rldynamics.plots.analysis import fig_paper_grid
    from rldynamics.plots.figure import RUN_COLORS

    first = make_run(tmp_path / "grpo", steps=4, analysis=(1, 4), name="grpo")
    second = make_run(tmp_path / "drgrpo", steps=4, analysis=(1, 4), name="drgrpo")
    fig = fig_paper_grid([load_run(first), load_run(second)], [1, 4])
    rows = np.asarray(fig.axes[:6]).reshape(2, 3)
    for row in rows:
        for ax in row[1:]:
            colors = {to_hex(line.get_color()) for line in ax.lines if line.get_linestyle() == "None"}
            assert {RUN_COLORS[0], RUN_COLORS[1]} <= colors  # both runs drawn in this row, in their own colours
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["grpo", "drgrpo"]
    out = tmp_path / "paper"
    assert plot_command([first, second], None, False, out, True, [1, 4]) == 0
    _assert_png(out / "paper_grid.png")


def test_gradient_tables_script_stacks_runs_by_analysis_round(tmp_path):
    first = make_run(tmp_path / "grpo", steps=4, analysis=(1, 4), name="grpo")
    second = make_run(tmp_path / "gae", steps=6, analysis=(3, 6), name="gae")  # analysed at other step numbers
    _add_intervals_and_group_norms(first, 4)
    script = Path(__file__).resolve().parents[1] / "scripts" / "gradient_tables.py"
    out = subprocess.run([sys.executable, str(script), str(first), str(second), "--by-step"], capture_output=True,
                         text=True, check=True).stdout
    rounds = out.split("### ")[1:]
    assert [r.splitlines()[0] for r in rounds] == ["analysis 1", "analysis 2",
                                                    "per-group log-log slopes against the group reward std"]
    assert "| grpo (1) | Q1 |" in rounds[0] and "| gae (3) | Q1 |" in rounds[0]
    assert "| grpo (4) | Q4 |" in rounds[1] and "| gae (6) | all |" in rounds[1]
    assert "| grpo | 4 | 0.5 ± " in rounds[2] and "(6) |" in rounds[2]  # task = 0.4·√RV over the 6 groups with RV > 0
    assert "| gae | 3 | – | – |" in rounds[2]  # no per-group norms: no slope


@pytest.mark.parametrize("link", ["report.html", "plots/training_curves.png",
                                  "plots/gradient_analysis_metrics_step_1.json", "paper/paper_grid.png"])
def test_plot_and_report_never_write_through_a_link(run, tmp_path, capsys, link):
    """A link in place of a file `rldyn plot` or `rldyn report` writes (left there by anyone) is refused in one
    line naming it; what it points to is never written."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    victim = tmp_path / "victim.txt"
    victim.write_text("not a figure")
    (copy / link).parent.mkdir(exist_ok=True)
    (copy / link).symlink_to(victim)
    if link == "report.html":
        code = report_command(copy)
    elif link.startswith("paper/"):
        code = plot_command([copy], None, False, copy / "paper", True, None)
    else:
        code = plot_command(copy, None, False, None, False, None)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"{copy / link} is a symbolic link" in err, err
    assert victim.read_text() == "not a figure"


# ---------------------------------------------------------------- the report's first screen and its figures


def _set_config(path: Path, **sections) -> None:
    cfg = yaml.safe_load((path / "config.yaml").read_text())
    cfg.update(sections)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_report_opens_with_headline_numbers_environment_and_samples(tmp_path):
    path = make_run(tmp_path / "h", steps=6, analysis=())  # validation 10 % at step 0, then 18, 26, 34 %
    RunWriter(path).log_samples(6, [{"seed": 7, "reward": -1.0, "success": 0.0, "text": "<answer>Up</answer> 7"},
                                    {"seed": 8, "reward": 10.0, "success": 1.0, "text": "<answer>Left</answer> 8"}])
    record_start(path, describe(0, 1, "model.threads=1", "cpu"))
    text = build_report(path)
    head = text[text.index('id="summary"'):text.index('id="checks"')]  # the run summary, after the Health section
    assert "10.0% → 34.0% (+24.0 points)" in head and "step 0 → step 6" in head  # start and end
    assert ">34.0%<" in head and "6 of" not in head  # best, and train.steps is not in this config
    assert "13 s" in head  # wall time: 6 steps x 2 s + the first validation's 1 s
    assert "torch" in head and "1 torch thread" in head and "model.threads=1" in head
    assert ">gradient analysis<" in head and ">off<" in head  # this run analysed no step
    assert ">steps 1, 4<" in build_report(make_run(tmp_path / "a", steps=4))  # the steps it analysed
    samples = text[text.index('id="samples"'):]
    assert samples.index("seed 8") < samples.index("seed 7")  # a success first
    assert "&lt;answer&gt;Left&lt;/answer&gt; 8" in samples


def test_falling_validation_is_flagged():
    def flags(values):
        rows = [{"step": 10 * i, names.val_success("sokoban"): v} for i, v in enumerate(values)]
        return [f.check for f in health.health_checks(rows, {"env": {"name": "sokoban"}})]

    assert flags([0.30, 0.27, 0.22]) == ["val_falling"]
    assert flags([0.10, 0.40, 0.25]) == ["val_past_peak"]
    assert flags([0.10, 0.12, 0.11]) == [] and flags([0.3, 0.1]) == []  # within noise; too few validations


def test_terms_that_are_off_get_no_panels(tmp_path):
    path = make_run(tmp_path / "off", steps=2, analysis=(1,), kl=False)
    _set_config(path, algo={"kl_coef": 0.0, "entropy_coef": 0.001})
    run = load_run(path)
    titles = [ax.get_title() for ax in fig_training_curves(run).axes]
    assert not any("KL" in t for t in titles) and any("entropy" in t for t in titles)
    sd = step_data(run, 1)
    for fig in (fig_grad_norms(sd), fig_losses(sd), fig_normed_grads(sd)):
        titles = [ax.get_title() for ax in fig.axes]
        assert "kl: off" in titles
        assert not any(t.startswith(("kl gradient", names.loss("kl"), "kl:  per")) for t in titles)
    _set_config(path, algo={"kl_coef": 0.001, "entropy_coef": 0.001})
    assert any("KL" in ax.get_title() for ax in fig_training_curves(load_run(path)).axes)


def _visible_tick_labels(axis, renderer):
    labels = [t for t in (*axis.get_majorticklabels(), *axis.get_minorticklabels()) if t.get_visible() and t.get_text()]
    return [(t.get_text(), t.get_window_extent(renderer)) for t in labels]


def test_log_axes_label_the_zero_slot_and_never_overlap(run):
    sd = step_data(load_run(run), 1)  # bucket_1 holds RV=0 groups only
    fig = fig_summary(sd)
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    ax = fig.axes[1]  # task norm vs bucket RV
    slot = ax.xaxis.get_minorticklocs()
    assert len(slot) == 1 and [t.get_text() for t in ax.xaxis.get_minorticklabels()] == ["0"]
    divider = 2 * slot[0]
    shown = [(float(x), lab.get_text()) for x, lab in zip(ax.xaxis.get_majorticklocs(), ax.xaxis.get_majorticklabels(),
                                                         strict=True) if lab.get_text()]
    assert shown and all(x >= divider for x, _ in shown)  # no decade labelled where the RV=0 points sit
    for figure in (fig, fig_reg_share(load_run(run))):
        figure.canvas.draw()
        for axes in figure.axes:
            for axis in (axes.xaxis, axes.yaxis):
                boxes = _visible_tick_labels(axis, figure.canvas.get_renderer())
                for (a, box_a), (b, box_b) in zip(boxes, boxes[1:]):
                    assert not any(box_a.overlaps(other) for _, other in boxes if other is not box_a), (a, b)


def test_regulariser_share_buckets_are_not_joined_across_steps(run):
    ax = fig_reg_share(load_run(run)).axes[0]
    styles = {line.get_label(): line.get_linestyle() for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert styles["all"] == "--" and styles and all(st == "None" for lab, st in styles.items() if lab != "all")


def test_a_single_group_bucket_is_a_point_not_a_box(run):
    from rldynamics.plots.analysis import fig_summary

    ax = fig_summary(step_data(load_run(run), 1)).axes[0]  # buckets of 2, 2, 2 and 3 groups: four boxes
    boxes = [line for line in ax.lines if line.get_label().startswith("_") and len(line.get_xdata()) == 2]
    assert {round(float(np.mean(line.get_xdata()))) for line in boxes} == {0, 1, 2, 3}
    sd = step_data(load_run(run), 1)
    sd.groups["bucket_3"] = [0.9]
    ax = fig_summary(sd).axes[0]
    box_x = {round(float(np.mean(line.get_xdata()))) for line in ax.lines
             if line.get_label().startswith("_") and len(line.get_xdata()) == 2}
    assert 2 not in box_x  # no box (a flat line) at the one-group bucket
    [point] = [line for line in ax.lines if line.get_label() == "a single group (no spread)"]
    assert point.get_xdata().tolist() == [2] and point.get_ydata().tolist() == [0.9]
    assert point.get_linestyle() == "None"


def test_cosine_panels_share_the_analysis_steps_x_range(tmp_path):
    from rldynamics.plots.curves import fig_cosines

    path = make_run(tmp_path / "late_kl", steps=4, analysis=(1, 4))
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # KL's cosines logged at step 4 only
        if row["step"] == 1:
            for key in [k for k in row if "/cos/task_kl" in k or "/cos/entropy_kl" in k]:
                del row[key]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    axes = fig_cosines(load_run(path)).axes
    assert len(axes) == 3 and len({ax.get_xlim() for ax in axes}) == 1
    low, high = axes[0].get_xlim()
    assert low < 1 and high > 4


def test_no_regulariser_share_figure_when_entropy_and_kl_are_off(tmp_path):
    from rldynamics.plots.curves import fig_reg_share

    path = make_run(tmp_path / "off", steps=4, analysis=(1, 4))
    _set_config(path, algo={"kl_coef": 0.0, "entropy_coef": 0.0})
    assert fig_reg_share(load_run(path)) is None
    page = build_report(path)
    assert "No regulariser share: both coefficients are 0 (algo.entropy_coef=0, algo.kl_coef=0)" in page
    assert "Regulariser share of the gradient per bucket" not in page
