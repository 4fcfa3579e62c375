"""The report leads with the run's health: events.jsonl read back, the health timeline, the verdict, the events table
with each event's samples, and the glossary that docs/health.md holds (written with the real RunWriter; no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from matplotlib.image import imread

from rldynamics import metric_names as names
from rldynamics.plots import glossary
from rldynamics.plots.cli import plot_command, report_command
from rldynamics.plots.data import load_run
from rldynamics.plots.health import health_checks
from rldynamics.plots.report import build_report
from rldynamics.plots.timeline import ACTION_COLORS, TIMELINE_FILE, fig_health_timeline, verdict
from rldynamics.tracking.run_dir import EVENTS_FILE, ROLLED_BACK, RunWriter, read_events

ROOT = Path(__file__).resolve().parents[1]


def _row(step: int, spike: bool = False) -> dict[str, float]:
    row = {names.SCORE_MEAN: 0.1 * step, names.ENTROPY: 1.0 - 0.05 * step,
           names.ACTOR_GRAD_NORM: 30.0 if spike else 0.5 + 0.01 * step,
           names.health("grad_spike"): float(spike), names.health("entropy_collapse"): float(step >= 3),
           names.HEALTH_ZERO_VARIANCE_SHARE: 0.25, names.ENTROPY_COV: 0.01}
    if step % 3 == 0:
        row[names.val_success("sokoban")] = 0.1 + 0.02 * step
    return row


def _samples(writer: RunWriter, step: int, note: str = "") -> None:
    writer.log_samples(step, [{"seed": 100 + step, "reward": 1.0, "success": 1.0,
                               "text": f"<answer>Up</answer> step {step}{note}"},
                              {"seed": 200 + step, "reward": -0.1, "success": 0.0, "text": f"loop loop {step}{note}"}])


def make_health_run(path: Path) -> Path:
    """Steps 1-9, a warn at 3 (entropy_collapse), a skip at 5 (grad_spike), a rollback asked for by mismatch at
    step 9 back to the checkpoint of step 6, then steps 7-10 again: what `train/trainer.py` leaves behind."""
    writer = RunWriter(path)
    (path / "config.yaml").write_text(yaml.safe_dump({"env": {"name": "sokoban"}, "train": {"steps": 10},
                                                      "log": {"name": "sick"}}))
    writer.log(0, {names.val_success("sokoban"): 0.1})
    for step in range(1, 10):
        writer.log(step, _row(step, spike=step == 5))
        _samples(writer, step, note=" first try" if step > 6 else "")
        if step == 3:
            writer.log_event({"step": 3, "rule": "entropy_collapse", "action": "warn", "value": 0.85,
                              "threshold": 0.9, "since": 3, "message": "entropy 0.85 < 0.9 x its start (0.95)"})
        if step == 5:
            writer.log_event({"step": 5, "rule": "grad_spike", "action": "skip", "value": 30.0, "threshold": 2.5,
                              "since": 5, "message": "gradient norm 30 > 2.5 (median + 10 MAD of the last 20 steps)"})
        if step == 9:
            writer.log_event({"step": 9, "rule": "mismatch", "action": "rollback", "value": 0.05,
                              "threshold": 0.01, "since": 8, "message": "sampler/trainer KL 0.05 > 0.01"})
    archive = writer.archive_after(6)
    writer.log_event({"step": 6, "rule": "rollback", "action": "rollback", "from_step": 9, "archive": archive.name,
                      "message": "steps 7-9 rolled back"})
    for step in range(7, 11):
        writer.log(step, _row(step))
        _samples(writer, step)
    writer.close()
    return path


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    img = imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and float(img[..., :3].std()) > 0.01


@pytest.fixture(scope="module")
def sick(tmp_path_factory) -> Path:
    return make_health_run(tmp_path_factory.mktemp("health") / "sick")


def test_read_events_reads_rows_skips_a_cut_last_line_and_is_empty_without_the_file(tmp_path, sick):
    assert read_events(tmp_path) == []
    rows = read_events(sick)
    assert [(r["step"], r["rule"], r["action"]) for r in rows] == [
        (3, "entropy_collapse", "warn"), (5, "grad_spike", "skip"), (6, "rollback", "rollback")]
    assert rows[-1]["from_step"] == 9 and rows[-1]["archive"] == "attempt_1"
    assert [r["rule"] for r in read_events(sick / ROLLED_BACK / "attempt_1")] == ["mismatch"]
    (tmp_path / EVENTS_FILE).write_text(json.dumps(rows[0]) + "\n" + '{"step": 7, "rule": "trunc')
    assert read_events(tmp_path) == rows[:1]
    (tmp_path / EVENTS_FILE).write_text('{"step": 7, "ru\n' + json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        read_events(tmp_path)


def test_events_load_with_the_undone_alarms_and_odd_rows_are_skipped_with_a_warning(tmp_path, sick):
    run = load_run(sick)
    assert [(e.step, e.rule, e.undone) for e in run.events] == [
        (3, "entropy_collapse", None), (5, "grad_spike", None), (6, "rollback", None), (9, "mismatch", "attempt_1")]
    assert run.events[2].is_rollback and run.events[2].from_step == 9 and run.events[3].action == "rollback"
    odd = make_health_run(tmp_path / "odd")
    with open(odd / EVENTS_FILE, "ab") as f:
        f.write(b'{"step": "x", "rule": "r", "action": "warn"}\n\xff\xfe\n{"step": 8, "rule": 3}\n')
        f.write(b'{"step": 8, "rule": "truncation", "action": "warn", "value": "n/a"}\n{"step": 9, "ru')
    run = load_run(odd)
    assert [e.rule for e in run.events if e.undone is None][-1] == "truncation"
    assert len([w for w in run.warnings if EVENTS_FILE in w]) == 3  # two odd rows, one undecodable line
    assert report_command(odd) == 0 and plot_command(odd) == 0
    _assert_png(odd / "plots" / TIMELINE_FILE)


def test_verdict_names_the_rollback_and_its_rule_the_skips_and_the_warnings(sick):
    v = verdict(load_run(sick))
    assert v.level == "error"
    assert "1 rollback (steps 7–9 undone after mismatch, back to the checkpoint of step 6)" in v.text
    assert "optimizer steps refused at 1 step (grad_spike)" in v.text and "1 warning (entropy_collapse)" in v.text


def slow_run(path: Path, events: list[dict]) -> Path:
    """The default run's validations with the given events (a `no_learning` warning, a clear)."""
    writer = RunWriter(path)
    curve = ((0, 0.152), (20, 0.158), (40, 0.168), (60, 0.197), (80, 0.223), (100, 0.246))
    for step, success in curve:
        writer.log(step, {names.val_success("sokoban"): success, names.SCORE_MEAN: 0.01 * step})
    for event in events:
        writer.log_event(event)
    writer.close()
    return path


WARNED = {"step": 60, "rule": "no_learning", "action": "warn", "value": 0.197, "threshold": 0.199,
          "since": 1,
          "message": "validation 19.7 % is not 2 standard errors above its start (15.2 %)"}
CLEARED = {"step": 80, "rule": "no_learning", "action": "clear", "since": 1,
           "message": "no_learning no longer fires (it did from step 60)"}


def test_verdict_says_when_a_warning_cleared(tmp_path):
    run = load_run(slow_run(tmp_path / "cleared", [WARNED, CLEARED]))
    v = verdict(run)
    assert (v.level, v.text) == ("warning", "1 warning (no_learning, cleared at step 80).")
    fig = fig_health_timeline(run)  # a clear is no alarm line
    colours = {line.get_color() for ax in fig.axes for line in ax.get_lines()}
    assert ACTION_COLORS["warn"] in colours and ACTION_COLORS["clear"] not in colours
    assert all(t.get_text() == "no_learning" for t in fig.axes[0].texts)
    table = build_report(run.path)
    table = table[table.index('<table class="events">'):]
    assert "act-clear" in table and "no_learning no longer fires (it did from step 60)" in table
    again = dict(WARNED, step=90)
    run = load_run(slow_run(tmp_path / "again", [WARNED, CLEARED, again]))
    assert verdict(run).text == "2 warnings (no_learning)."  # firing again at the end: not cleared


def test_report_leads_with_health_verdict_timeline_events_samples_and_glossary(sick):
    page = build_report(sick)
    body = page[page.index("<body>"):]
    assert body.index('<h2 id="health">Health</h2>') < body.index('id="summary"') < body.index('id="checks"') < \
        body.index('id="curves"')
    assert body.index("<h2") == body.index('<h2 id="health">') < body.index('class="headline"')  # before all else
    health = body[body.index('id="health"'):body.index('id="summary"')]
    assert "1 rollback" in health and "after mismatch" in health
    assert health.count("data:image/png;base64,") == 1  # the timeline
    table = health[health.index('<table class="events">'):health.index("</table>")]
    rows = table.split("<tr>")[2:]
    assert [r.split("</td>")[0].removeprefix("<td>")[:1] for r in rows] == ["3", "5", "9", "6"]  # as it happened
    assert "entropy_collapse" in rows[0] and "act-warn" in rows[0] and "0.85 vs 0.9" in rows[0]
    assert "act-skip" in rows[1] and "30 vs 2.5" in rows[1]
    assert "undone (attempt_1)" in rows[2] and "mismatch" in rows[2]
    assert "steps 7–9 undone" in rows[3] and "asked for by <b>mismatch</b> at step 9" in rows[3]
    # the samples of an alarm's step, escaped; an undone step's come from its rolled_back/ attempt
    assert "2 samples of step 3" in rows[0] and "&lt;answer&gt;Up&lt;/answer&gt; step 3<" in rows[0]
    assert "step 9 first try" in rows[2] and "step 9 first try" in rows[3]
    assert f'href="#{glossary.anchor("mismatch")}"' in rows[2]
    gloss = health[health.index('id="glossary"'):]
    assert gloss.index(f'id="{glossary.anchor("entropy_collapse")}"') < gloss.index("<details>")  # fired: open
    assert all(f'id="{glossary.anchor(name)}"' in gloss for name in [*glossary.RULES, *glossary.SIGNALS])
    assert "Cui et al. 2025" in gloss and "<code>algo.tis_cap</code>" in gloss


def test_plot_writes_the_timeline_and_it_draws_each_action_colour(sick):
    assert plot_command(sick) == 0
    _assert_png(sick / "plots" / TIMELINE_FILE)
    fig = fig_health_timeline(load_run(sick))
    colours = {line.get_color() for ax in fig.axes for line in ax.get_lines()}
    assert {ACTION_COLORS["warn"], ACTION_COLORS["skip"], ACTION_COLORS["rollback"]} <= colours
    assert len(fig.axes) == 4  # validation success, reward, entropy, grad norm
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert any(t == "mismatch\n(undone)" for t in labels) and any("grad_spike" in t for t in labels)


def test_a_run_without_events_still_reports_no_alarms(tmp_path):
    path = tmp_path / "calm"
    writer = RunWriter(path)
    for step in range(1, 5):
        writer.log(step, {names.SCORE_MEAN: 0.1 * step, names.health("grad_spike"): 0.0})
    assert report_command(path) == 0
    page = (path / "report.html").read_text()
    health = page[page.index('id="health"'):page.index('id="summary"')]
    assert "No alarms: no health rule fired." in health and "data:image/png;base64," in health
    assert plot_command(path) == 0
    _assert_png(path / "plots" / TIMELINE_FILE)
    assert fig_health_timeline(load_run(path)).axes[0].get_title(loc="right") == "no alarms"


def test_the_timeline_never_fails_the_report(tmp_path, monkeypatch, capsys):
    path = make_health_run(tmp_path / "broken")

    def broken(run):
        raise ValueError("odd input\nsecond line")

    monkeypatch.setattr("rldynamics.plots.timeline.fig_health_timeline", broken)
    assert report_command(path) == 0 and plot_command(path) == 0
    err = capsys.readouterr().err
    assert err.count("the health timeline could not be drawn (ValueError: odd input)") == 2
    assert "1 rollback" in (path / "report.html").read_text()


def zero_variance_rows() -> list[dict]:
    """Ten steps on which 55 % of the 8 groups had equal rewards."""
    row = {names.FILTER_ZERO_COUNT: 4.4, names.FILTER_KEPT_COUNT: 8.0, names.FILTER_KEPT_RATIO: 1.0}
    return [{"step": s, **row} for s in range(1, 11)]


@pytest.mark.parametrize(("algo", "says"), [
    ({"adv_estimator": "grpo", "entropy_coef": 0.0, "kl_coef": 0.0}, "contribute no gradient"),
    ({"adv_estimator": "grpo", "entropy_coef": 0.001, "kl_coef": 0.0}, "algo.entropy_coef=0.001"),
    ({"adv_estimator": "rloo", "entropy_coef": 0.0, "kl_coef": 0.05}, "algo.kl_coef=0.05"),
])
def test_the_zero_variance_advice_follows_the_runs_regularisers(algo, says):
    config = {"algo": algo, "train": {"env_groups": 8}}
    flags = health_checks(zero_variance_rows(), config)
    [flag] = [f for f in flags if f.check == "zero_variance_groups"]
    assert flag.title == "55% of groups have zero reward variance (last 10 steps)"
    assert says in flag.detail
    on = algo["entropy_coef"] or algo["kl_coef"]
    assert ("dominate" in flag.detail) == bool(on)
    assert ("contribute no gradient" in flag.detail) == (not on)


# ---------------------------------------------------------------- the glossary: one source, docs/health.md holds it


def test_the_glossary_covers_every_rule_and_every_signal():
    assert set(glossary.SIGNALS) == {
        names.HEALTH_ZERO_VARIANCE_SHARE, names.HEALTH_REPETITION_RATE, names.health_reward_share("<component>"),
        names.ENTROPY_COV, names.ENTROPY_CHANGE, names.RESPONSE_CLIP_RATIO, names.CLIP_HIT_RATE,
        *(names.actor_group(m, glossary.GROUP) for m in (names.GROUP_GRAD_NORM, names.GROUP_GRAD_NORM_CLIPPED,
                                                          names.GROUP_UPDATE_RATIO))}
    for entry in [*glossary.RULES.values(), *glossary.SIGNALS.values()]:
        assert entry.fires and entry.means


def test_docs_health_holds_the_generated_glossary():
    page = (ROOT / "docs" / "health.md").read_text()
    block = page[page.index(glossary.BEGIN) + len(glossary.BEGIN):page.index(glossary.END)]
    assert block == "\n\n" + glossary.markdown() + "\n", \
        "docs/health.md's glossary is stale: run `python -m rldynamics.plots.glossary docs/health.md`"


def test_docs_health_lists_every_health_key_with_its_default():
    from rldynamics.config import Config, documented_keys

    page = (ROOT / "docs" / "health.md").read_text()
    keys = [(k, d) for k, d, _ in documented_keys(Config()) if k.startswith("health.")]
    assert len(keys) > 20
    missing = [k for k, d in keys if f"| `{k}` | `{d}` |" not in page]
    assert not missing, f"health.* keys without their row (key, default) in docs/health.md: {missing}"
    assert "## Default thresholds and the runs they were measured on" in page
