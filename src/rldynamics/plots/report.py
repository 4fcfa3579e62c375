"""`rldyn report`: one self-contained HTML page for a run directory.

First the run's health (`health_section`): a one-line verdict from the health monitor's events.jsonl, the health
timeline (`plots/timeline.py`), a table of the events with the decoded samples of each event's step (folded), and
the glossary of the rules and signals (`plots/glossary.py`, the text of docs/health.md). Then the headline numbers
(validation success at the start and the end, the best validation and its step, steps run, wall time, what
computed the run), the post-run checks over the metrics (`plots/health.py`), the training curves, the gradient
analysis (across-step views, then per analysis step its figures, with the bucket-metrics table folded), the sample
browser of the step records (`plots/browser.py`: every recorded step's prompts and replies token by token, shaded by
advantage, entropy, sampler/trainer mismatch or attribution; a run without records gets a few decoded samples),
the reward components, and the resolved config (folded). Figures are embedded as base64 PNG, the browser's script and
data and the style sheet are inline, so the file can be mailed or opened offline; nothing external is loaded.
"""

from __future__ import annotations

import html
import math
from datetime import datetime, timezone
from pathlib import Path

from rldynamics import metric_names as naming
from rldynamics.plots import glossary
from rldynamics.plots.analysis import STEP_FIGURES, step_data
from rldynamics.plots.browser import CSS as BROWSER_CSS
from rldynamics.plots.browser import browser_section
from rldynamics.plots.collapse import check_template_collapse, fig_mi_entropy, fig_regimes, mode_of
from rldynamics.plots.curves import (
    fig_cosines,
    fig_reg_share,
    fig_sketch_cosines,
    fig_training_curves,
    reg_share_off,
)
from rldynamics.plots.data import (
    PREFIX,
    HealthEvent,
    RunData,
    analysis_steps,
    as_float,
    bucket_label,
    bucket_metric_names,
    env_names,
    headline,
    load_run,
    norm_is_zero,
)
from rldynamics.plots.figure import figure_html, fmt
from rldynamics.plots.health import Flag, health_checks, summary_line
from rldynamics.plots.reward_components import (
    check_reward_components,
    component_names,
    fig_component_rewards,
    fig_cosine_matrix,
    fig_cosines_over_steps,
    fig_layer_profile,
    fig_response_lengths,
    read_reward_grad,
)
from rldynamics.plots.timeline import ACTION_COLORS, alarms, rollback_cause, timeline_or_none, undone_steps, verdict
from rldynamics.tracking.environment import PACKAGES, read_environment
from rldynamics.tracking.files import write_file
from rldynamics.tracking.run_dir import ROLLED_BACK, read_samples

STEP_FIGURE_TITLES = {
    "summary": "Summary: per-group RV, task and regulariser gradient vs RV",
    "plots": "Gradient norms per bucket",
    "loss_plots": "Losses per bucket",
    "reward_std": "Reward variance per bucket",
    "normed_grads": "Per-sample and per-token gradient norms",
    "groups": "Per-group gradient norms vs reward std (log-log, fitted slope)",
}

CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 0 auto; max-width: 1300px;
       padding: 1.5em 2em; color: #222; line-height: 1.45; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
h3 { margin-top: 1.6em; } .meta { color: #666; font-size: 0.9em; }
nav a { margin-right: 1.2em; } figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.name, th.name { text-align: left; font-family: monospace; }
.flag { border-left: 5px solid #999; background: #fafafa; padding: 0.5em 1em; margin: 0.7em 0; }
.flag.error { border-color: #c62828; background: #fdecea; }
.flag.warning { border-color: #ef6c00; background: #fff4e5; }
.flag.note { border-color: #1565c0; background: #eef4fb; }
.badge { font-weight: bold; text-transform: uppercase; font-size: 0.75em; margin-right: 0.6em; }
.ok { border-left: 5px solid #2e7d32; background: #edf7ed; padding: 0.6em 1em; }
.flag table { margin-top: 0.3em; } .missing { color: #b00; } .undef { color: #888; font-style: italic; }
.headline { display: flex; flex-wrap: wrap; gap: 0.8em; margin: 1em 0 0.4em; }
.headline .cell { border: 1px solid #ddd; border-radius: 4px; padding: 0.5em 1em; min-width: 12em; }
.headline .label { color: #666; font-size: 0.85em; } .headline .value { font-size: 1.35em; font-weight: bold; }
details pre { white-space: pre-wrap; }
td.text, th.text { text-align: left; max-width: 40em; } td.samples { text-align: left; min-width: 14em; }
.action { font-weight: bold; } .verdict { font-size: 1.1em; }
.gloss { margin: 0.6em 0 1em; } .gloss dl { margin: 0.2em 0 0 1em; } .gloss dt { font-weight: bold; color: #444; }
.gloss dd { margin: 0 0 0.3em 1.2em; }
""" + "".join(f".act-{a} {{ color: {c}; }}\n" for a, c in ACTION_COLORS.items()) + BROWSER_CSS


def _flag_html(flag: Flag) -> str:
    rows = "".join(f'<tr><td class="name">{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>'
                   for k, v in flag.numbers.items())
    return (f'<div class="flag {flag.severity}"><span class="badge">{flag.severity}</span>'
            f"<b>{html.escape(flag.title)}</b><br>{html.escape(flag.detail)}"
            f"{f'<table>{rows}</table>' if rows else ''}</div>")


SAMPLES_PER_EVENT = 4  # decoded samples shown under an event (log.samples_per_step writes 4 per step by default)
MAX_EVENT_ROWS = 200
VERDICT_CLASS = {"error": "flag error", "warning": "flag warning", "ok": "ok"}


def health_section(run: RunData) -> str:
    """The Health section: the verdict, the timeline, the events table, the glossary."""
    v = verdict(run)
    out = ['<h2 id="health">Health</h2>',
           f'<p class="verdict {VERDICT_CLASS[v.level]}">{html.escape(v.text)}</p>',
           figure_html(timeline_or_none(run), "Health timeline: the main curves with every health event at its step "
                       "(colour: its action; shaded: steps a rollback undid; dotted: alarms of those steps)"),
           events_table(run), glossary_section(run)]
    return "".join(out)


def ordered_events(run: RunData) -> list[HealthEvent]:
    """The events in the order they happened: events.jsonl's rows, with the alarms of the steps a rollback undid
    (its `rolled_back/` attempt) just before the rollback's row."""
    undone: dict[str, list[HealthEvent]] = {}
    for e in run.events:
        if e.undone is not None:
            undone.setdefault(e.undone, []).append(e)
    out = []
    for e in run.events:
        if e.undone is None:
            out += undone.pop(e.archive, []) if e.is_rollback and e.archive else []
            out.append(e)
    return out + [e for rest in undone.values() for e in rest]


def _sample_head(s: dict, step: int) -> str:
    return (f"step {step} · seed {s.get('seed', '?')} · reward {fmt(as_float(s.get('reward')))} · "
            f"{'success' if as_float(s.get('success', 0)) > 0 else 'no success'}")


def _event_samples(run: RunData, cache: dict, where: str | None, step: int) -> str:
    """The decoded samples of `step` (from `rolled_back/<where>/` for an undone step), folded; escaped."""
    if where not in cache:
        try:
            cache[where] = read_samples(run.path if where is None else run.path / ROLLED_BACK / where)
        except (ValueError, UnicodeDecodeError, OSError):
            cache[where] = []
    found = [s for s in cache[where] if isinstance(s, dict) and s.get("step") == step][:SAMPLES_PER_EVENT]
    if not found:
        return '<span class="meta">none logged</span>'
    body = "".join(f'<div class="meta">{html.escape(_sample_head(s, step))}</div>'
                   f"<pre>{html.escape(str(s.get('text', '')))}</pre>" for s in found)
    return (f"<details><summary>{len(found)} sample{'s' if len(found) > 1 else ''} of step {step}</summary>"
            f"{body}</details>")


def _event_row(run: RunData, e: HealthEvent, cache: dict) -> str:
    step = f"{e.step}" + (f'<br><span class="meta">undone ({html.escape(e.undone)})</span>' if e.undone else "")
    rule = (f'<a href="#{glossary.anchor(e.rule)}">{html.escape(e.rule)}</a>' if e.rule in glossary.RULES
            else html.escape(e.rule))
    message = html.escape(e.message)
    if e.is_rollback:
        cause = rollback_cause(run, e)
        seen = f"{undone_steps(e)} undone"
        message += (f"<br>asked for by <b>{html.escape(cause.rule)}</b> at step {cause.step}" if cause else "")
        message += f'<br><span class="meta">their rows: {ROLLED_BACK}/{html.escape(e.archive or "?")}/</span>'
        samples = _event_samples(run, cache, e.archive, e.from_step)
    else:
        seen = f"{fmt(e.value)} vs {fmt(e.threshold)}" if e.value is not None or e.threshold is not None else ""
        samples = _event_samples(run, cache, e.undone, e.step)
    action = f'<span class="action act-{e.action}">' if e.action in ACTION_COLORS else "<span>"
    return (f'<tr><td>{step}</td><td class="name">{rule}</td><td class="name">{action}{html.escape(e.action)}</span>'
            f'</td><td>{html.escape(seen)}</td><td class="text">{message}</td><td class="samples">{samples}</td></tr>')


def events_table(run: RunData) -> str:
    """One row per health event (step, rule, action, value vs threshold, message, the step's samples folded)."""
    events = ordered_events(run)
    if not events:
        return ('<p class="meta">No events.jsonl rows: no health rule started firing (the monitor writes one row '
                "when a rule starts firing, and one per rollback).</p>")
    cache: dict = {}
    rows = "".join(_event_row(run, e, cache) for e in events[:MAX_EVENT_ROWS])
    more = (f'<p class="meta">{len(events) - MAX_EVENT_ROWS} more events are left out; events.jsonl holds them.'
            "</p>" if len(events) > MAX_EVENT_ROWS else "")
    return ('<table class="events"><tr><th>step</th><th class="name">rule</th><th class="name">action</th>'
            '<th>value vs threshold</th><th class="text">message</th><th class="text">samples of the step</th></tr>'
            f"{rows}</table>{more}")


def glossary_section(run: RunData) -> str:
    """The glossary (docs/health.md's text): the entries of the rules that fired in this run, open; the other rules
    and the signals folded."""
    fired = list(dict.fromkeys(e.rule for e in alarms(run) if e.rule in glossary.RULES))
    rest = [r for r in glossary.RULES if r not in fired] + list(glossary.SIGNALS)
    out = ['<h3 id="glossary">Glossary</h3>']
    if fired:
        out.append('<p class="meta">The rules that fired in this run: what they mean, their typical causes, what '
                   "to try.</p>" + "".join(glossary.entry_html(r) for r in fired))
    out.append(f"<details><summary>{'The other rules' if fired else 'Every rule'} and the signals the monitor logs "
               f"({len(rest)} entries, as in docs/health.md)</summary>"
               f"{''.join(glossary.entry_html(r) for r in rest)}</details>")
    return "".join(out)


def checks_section(run: RunData) -> str:
    """The post-run checks over the metrics rows (`plots/health.py`): a summary line and one box per flag."""
    if not run.rows:
        return '<h2 id="checks">Post-run checks</h2><p class="meta">No metrics rows were logged: nothing to check.</p>'
    flags = health_checks(run.rows, run.config)
    body = "".join(_flag_html(f) for f in flags)
    summary = html.escape(summary_line(flags))
    return (f'<h2 id="checks">Post-run checks</h2><p class="meta">Rules of thumb over the logged metrics, for any run '
            f'(also one trained without the health monitor).</p><p class="{"ok" if not flags else "meta"}">{summary}'
            f"</p>{body}")


def bucket_table(run: RunData, step: int) -> str:
    """HTML table of every logged bucket metric of `step`: rows = metrics, columns = `all`, Q1, Q2, …"""
    sd = step_data(run, step)
    buckets = ["all", *sd.buckets] if any(k.startswith(f"{PREFIX}/all/") for k in sd.row) else sd.buckets
    head = "".join(f"<th>{html.escape(bucket_label(b, run.bucket_mode, run.zero_bucket))}</th>" for b in buckets)
    rows, undefined = [], False
    for name in bucket_metric_names(sd.row):
        comps = name[4:].split("_") if name.startswith("cos/") else []
        cells = []
        for b in buckets:
            key = f"{PREFIX}/{b}/{name}"
            if key not in sd.row:
                cells.append('<td class="missing">—</td>')
            elif any(norm_is_zero(sd.row, b, c) for c in comps) or (
                    name == "reg_share" and math.isnan(as_float(sd.row[key]))):
                undefined = True
                cells.append('<td class="undef">undef.</td>')
            else:
                cells.append(f"<td>{html.escape(fmt(as_float(sd.row[key])))}</td>")
        rows.append(f'<tr><td class="name">{html.escape(name)}</td>{"".join(cells)}</tr>')
    legend = '<p class="meta">— not logged'
    legend += ("; undef.: a cosine with a gradient that is exactly zero (flagged by zero_grad/&lt;component&gt; = 1), "
               "or reg_share with task and regulariser both zero (0/0); logged as NaN</p>" if undefined else "</p>")
    return f'<table><tr><th class="name">metric</th>{head}</tr>{"".join(rows)}</table>{legend}'


def analysis_section(run: RunData) -> str:
    """Across-step views, then per analysis step its table and figures (or a note when there are none)."""
    steps = analysis_steps(run)
    out = ['<h2 id="analysis">Gradient analysis</h2>']
    if not steps:
        out.append('<p class="meta">No gradient-analysis steps in this run (no non-zero <code>grad_norm/bucket_*</code>'
                   " metrics); enable it with <code>analysis.enabled=true analysis.every=N</code>.</p>")
        return "".join(out)
    buckets = ("Buckets are the fixed intervals of within-group reward std (RV) they are named by; empty intervals "
               "are left out." if run.bucket_mode == "fixed_rv" else
               "Buckets Q1…QB go from the lowest to the highest within-group reward variance (RV).")
    out.append(f'<p class="meta">Analysis steps: {", ".join(map(str, steps))}. {buckets} Norms of entropy and KL '
               "are weighted by their coefficients unless marked raw.</p>")
    out.append(figure_html(fig_cosines(run), "Cosines between the task, entropy and KL gradients per bucket"))
    off = reg_share_off(run)
    out.append(f'<p class="meta">{html.escape(off)}</p>' if off else
               figure_html(fig_reg_share(run), "Regulariser share of the gradient per bucket"))
    for step in steps:
        sd = step_data(run, step)
        out.append(f'<h3 id="step-{step}">Step {step}</h3>')
        for name, make in STEP_FIGURES.items():
            out.append(figure_html(make(sd), STEP_FIGURE_TITLES[name]))
        metrics = len(bucket_metric_names(sd.row))
        out.append(f"<details><summary>bucket metrics of step {step} ({metrics} metrics × {len(sd.buckets)} buckets"
                   f" and all; the numbers behind the figures)</summary>{bucket_table(run, step)}</details>")
        out.append(figure_html(fig_sketch_cosines(run, step),
                               "Cosine between buckets' task gradients (count-sketch)"))
    return "".join(out)


def reward_components_section(run: RunData) -> str:
    """Reward components: health flags, component curves, gradient cosines over steps, per-step matrices."""
    names = component_names(run)
    if not names:
        return ""
    out = ['<h2 id="reward-components">Reward components</h2>',
           f'<p class="meta">Components: {", ".join(html.escape(n) for n in names)}. Gradient cosines '
           "(<code>analysis.reward_grad=true</code>) with a zero gradient — a component constant within every "
           "group — are undefined and shown as n/a, never as 0.</p>"]
    flags = check_reward_components(run)
    out += [_flag_html(f) for f in flags] or ['<p class="ok">No reward-component warnings.</p>']
    out.append(figure_html(fig_component_rewards(run), "Reward components per step (raw means; groups where constant)"))
    out.append(figure_html(fig_response_lengths(run), "Response length distribution per step"))
    out.append(figure_html(fig_cosines_over_steps(run), "Component gradient cosines per analysis step (all bucket)"))
    for step, matrices in read_reward_grad(run).items():
        out.append(f"<h3>Reward components, step {step}</h3>")
        out.append(figure_html(fig_cosine_matrix(matrices, step), f"Component gradient cosine matrix, step {step}"))
        out.append(figure_html(fig_layer_profile(matrices, step), f"Per-layer-group cosine profile, step {step}"))
    return "".join(out)


def collapse_section(run: RunData) -> str:
    """Template-collapse diagnostics: the health rule, MI and entropy over steps, the entropy-vs-MI plane."""
    mode = mode_of(run)
    if mode is None:
        return ""
    out = ['<h2 id="collapse">Template collapse (mutual information)</h2>',
           f'<p class="meta">Cross-scoring of the <code>{html.escape(mode)}</code> pairs (docs/collapse.md): MI '
           "estimate I(X;Z), conditional entropy H(Z|X) and marginal entropy H(Z) per token, retrieval accuracy "
           "of the prompt from the reply above chance. Rule: entropy steady while MI or retrieval above chance "
           "falls to half its peak = template collapse.</p>"]
    flags = check_template_collapse(run.rows)
    out += [_flag_html(f) for f in flags] or ['<p class="ok">No template collapse: MI and retrieval did not fall '
                                              "while the entropy held or rose.</p>"]
    out.append(figure_html(fig_mi_entropy(run), "MI and entropy over the diagnosed steps; retrieval above chance"))
    out.append(figure_html(fig_regimes(run), "Entropy vs MI: the four regimes and the run's path"))
    return "".join(out)


def headline_section(run: RunData) -> str:
    """The numbers a reader wants first: validation success at the start, the end and its best, steps, wall time."""
    h = headline(run)
    cells = []
    if h.val:
        (s0, v0), (s1, v1), (sb, vb) = h.val
        cells += [("validation success", f"{v0:.1%} → {v1:.1%} ({100 * (v1 - v0):+.1f} points)",
                   f"step {s0} → step {s1}"),
                  ("best validation", f"{vb:.1%}", f"step {sb}")]
    else:
        cells.append(("validation success", "not logged", "val.every=0 and val.before_train=false"))
    if h.steps is not None:
        cells.append(("steps", f"{h.last_step} of {h.steps}", h.stopped or "as configured"))
    if h.left is not None:
        cells.append(("policy left", f"the state of step {h.left}", f"checkpoints/step_{h.left}, from before the "
                                                                    "trouble"))
    if h.wall_s is not None:
        cells.append(("wall time", _duration(h.wall_s), "steps and validations (model build and warm start not "
                                                         "counted)"))
    analysed = analysis_steps(run)
    cells.append(("gradient analysis", f"step{'s' if len(analysed) > 1 else ''} {', '.join(map(str, analysed))}"
                  if analysed else "off", "figures below" if analysed else "analysis.enabled=true turns it on"))
    body = "".join(f'<div class="cell"><div class="label">{html.escape(a)}</div><div class="value">{html.escape(b)}'
                   f'</div><div class="meta">{html.escape(c)}</div></div>' for a, b, c in cells)
    return f'<div class="headline">{body}</div>{environment_line(run)}'


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min {s} s" if minutes else f"{s} s"


def environment_line(run: RunData) -> str:
    """What computed the run (`environment.jsonl`): versions, threads, device, the tiny model's weights hash."""
    records = read_environment(run.path)
    if not records:
        return '<p class="meta">No environment.jsonl: the versions and threads of this run were not recorded.</p>'
    lines = []
    for r in records:
        versions = ", ".join(f"{p} {r.get(p, '?')}" for p in PACKAGES)
        model = f"; initial weights sha256 {str(r['base_model_sha256'])[:12]}…" if r.get("base_model_sha256") else ""
        since = f" (from step {r.get('start_step', '?')})" if len(records) > 1 else ""
        threads = r.get("threads", "?")
        lines.append(f"{versions}; {threads} torch thread{'' if threads == 1 else 's'} ({r.get('threads_from', '?')}) "
                     f"on {r.get('device', '?')}{model}{since}")
    return '<p class="meta">Computed with ' + "<br>".join(html.escape(x) for x in lines) + "</p>"


def samples_section(run: RunData, per_step: int = 2) -> str:
    """The sample browser of the run's step records (`plots/browser.py`); without records, a few training
    trajectories as the model wrote them (`decoded_samples`)."""
    browser = browser_section(run.path)
    if browser is None:
        return decoded_samples(run, per_step, '<h2 id="samples">Sample trajectories</h2>')
    text, steps = browser
    return text if steps else text + decoded_samples(run, per_step)  # no record readable: samples.jsonl's


def decoded_samples(run: RunData, per_step: int = 2, heading: str = "") -> str:
    """A few training trajectories as the model wrote them, from the first and the last step with samples (a success
    first where there is one), folded."""
    samples = read_samples(run.path)
    if not samples:
        return ""
    steps = sorted({s["step"] for s in samples})
    out = [heading,
           f'<p class="meta">Training rollouts of steps {steps[0]} and {steps[-1]} (samples.jsonl holds '
           f"log.samples_per_step of every step: {len(samples)} in all).</p>"]
    for step in dict.fromkeys((steps[0], steps[-1])):
        rows = sorted((s for s in samples if s["step"] == step), key=lambda s: -as_float(s.get("success", 0)))
        for s in rows[:per_step]:
            out.append(f"<details><summary>{html.escape(_sample_head(s, step))}</summary>"
                       f"<pre>{html.escape(str(s.get('text', '')))}</pre></details>")
    return "".join(out)


def _config_section(run: RunData) -> str:
    file = run.path / "config.yaml"
    text = file.read_text(encoding="utf-8", errors="replace") if file.exists() else None
    body = (f"<details><summary>config.yaml (resolved)</summary><pre>{html.escape(text)}</pre></details>" if text
            else '<p class="meta">No config.yaml in the run directory.</p>')
    return f'<h2 id="config">Config</h2>{body}'


def build_report(run_dir: str | Path | RunData) -> str:
    """The report of `run_dir` (a path or an already loaded run) as one HTML string."""
    run = run_dir if isinstance(run_dir, RunData) else load_run(run_dir)
    steps = [r["step"] for r in run.rows]
    span = f"steps {steps[0]}–{steps[-1]} ({len(steps)} logged)" if steps else "no metrics rows"
    curves = fig_training_curves(run)
    parts = [
        f"<h1>{html.escape(run.name)}</h1>",
        f'<p class="meta">run directory <code>{html.escape(str(run.path.resolve()))}</code> · {span} · '
        f"report generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} by rldynamics</p>",
        '<nav><a href="#health">Health</a><a href="#summary">Summary</a><a href="#checks">Post-run checks</a>'
        '<a href="#curves">Training curves</a>'
        '<a href="#analysis">Gradient analysis</a><a href="#samples">Samples</a>'
        '<a href="#reward-components">Reward components</a><a href="#collapse">Template collapse</a>'
        '<a href="#config">Config</a></nav>',
        health_section(run),
        '<h2 id="summary">Run summary</h2>',
        headline_section(run),
        checks_section(run),
        '<h2 id="curves">Training curves</h2>',
        figure_html(curves, "Training curves") if curves
        else '<p class="meta">No known training metrics were logged.</p>',
        analysis_section(run),
        samples_section(run),
        reward_components_section(run),
        collapse_section(run),
        _config_section(run),
    ]
    title = html.escape(f"rldynamics report — {run.name}")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n")


HEALTH_REPORT = "health_report.html"  # the health page `rldyn doctor` and the TRL callback write


def health_page(run: RunData, notes: list[str]) -> str:
    """A page with the Health section alone (verdict, timeline, events, glossary) under the run's name and
    `notes` (one line each: what was read, what could not be checked): the report of logs read by
    `rldyn doctor` or of a run watched by the TRL callback."""
    meta = "<br>".join(html.escape(n) for n in notes)
    title = html.escape(f"rldynamics health report — {run.name}")
    body = f'<h1>{html.escape(run.name)}</h1><p class="meta">{meta}</p>{health_section(run)}'
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head><body>{body}</body></html>\n")


def result_lines(run: RunData, report: Path | None = None) -> list[str]:
    """What the console says when a run ends: validation at the start and the end with their standard errors, the
    health verdict, where the report is."""
    h = headline(run)
    lines = []
    if h.val:
        (s0, v0), (s1, v1), (sb, vb) = h.val
        se = _val_se(run)
        best = f"; best {vb:.1%} at step {sb}" if sb not in (s0, s1) else ""
        lines.append(f"result: validation success {v0:.1%}{se.get(s0, '')} at step {s0} -> {v1:.1%}"
                     f"{se.get(s1, '')} at step {s1} ({100 * (v1 - v0):+.1f} points{best})")
    else:
        lines.append("result: no validation logged (val.every=0 and val.before_train=false)")
    if h.stopped:
        lines.append(f"stopped: {h.stopped}")
    if h.left is not None:
        lines.append(f"left: {left_words(run, h.left)}")
    lines.append(f"health: {verdict(run).text}")
    if report is not None:
        lines.append(f"report: {report}")
    return lines


def left_words(run: RunData, step: int) -> str:
    """What a run that stopped with an earlier state leaves: that state's checkpoint and its validation, if any."""
    envs = env_names(run)
    key = naming.val_success(envs[0]) if envs else None
    val = next((r[key] for r in run.rows if r["step"] == step and isinstance(r.get(key), (int, float))), None)
    said = (f"validation success {val:.1%}{_val_se(run).get(step, '')} at that step" if val is not None
            else f"not validated: rldyn eval {run.path / 'checkpoints' / f'step_{step}'}")
    return (f"the state of step {step}, from before the trouble, as the last checkpoint (checkpoints/step_{step}; "
            f"{said})")


def _val_se(run: RunData) -> dict[int, str]:
    """` ± x.x %` by step, where the validation logged its standard error (clustered by problem)."""
    envs = env_names(run)
    key = naming.env_metric(envs[0], naming.SUCCESS_SE, validation=True) if envs else None
    return {r["step"]: f" ± {float(r[key]):.1%}" for r in run.rows
            if key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key])}


def write_report(run_dir: str | Path | RunData, out: str | Path | None = None) -> Path:
    """Write the report (default `RUN_DIR/report.html`) and return its path."""
    base = run_dir.path if isinstance(run_dir, RunData) else Path(run_dir)
    path = Path(out) if out is not None else base / "report.html"
    text = build_report(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file(path, text)  # atomically, never through a link (`tracking.files`)
