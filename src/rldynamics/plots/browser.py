"""The report's sample browser: the rollout of every recorded step (`records/step_<N>.safetensors`,
`tracking/step_records.py`) prompt by prompt, reply by reply and token by token, in the one offline page.

For the step chosen in the selector (each labelled with why it was recorded): histograms of the trajectory rewards,
the kept rows' mean advantages and the groups' mean rewards, beside them the shares of groups whose rows all / none
succeed; then every group: its prompt once, and each reply with its reward (total and per component), its mean
advantage, its success and whether the filter kept it, its tokens (observations between turns plain) shaded by a
chosen quantity (`SHADINGS`), each token's values in its tooltip. With `rldyn replay --attribute`'s
`replays/step_<N>/attribution.json` each reply also shows its share of the step's gradient and its cosine with it,
the replies of largest share are marked and listed, and the listed tokens can be shaded by their score.

Size: each step's data is one JSON blob: token ids as indexes into one pieces table shared by every step (the
most frequent first) written as short strings of base-32 digits, values to 3 significant digits, a value constant
over a reply stored once. A small inline script builds a group's spans only when it is opened, for the chosen step
only. A record that cannot be read is one line of the section, never a failed report. Imports no torch (numpy and
the record reader).
"""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from rldynamics.plots.figure import figure_html, fmt, new_figure, note
from rldynamics.tracking.step_records import (
    ATTRIBUTION_FILE,
    RECORDS_DIR,
    REPLAYS_DIR,
    OptimizerStepRecord,
    RecordedStep,
    RecordError,
    attribution_path,
    record_step,
    records,
)

TOP_REPLIES = 5  # replies of largest |share| marked and listed per step


@dataclass(frozen=True)
class Shading:
    """A choice of the shading control: its label, what its colours mean, the magnitude below which full colour is
    never reached (so that float rounding does not look like a large value)."""

    label: str
    legend: str
    floor: float = 0.0


SHADINGS = {  # blob key of the per-token values -> their shading
    "none": Shading("none", "tokens unshaded"),
    "adv": Shading("advantage", "the trained advantage of each sampled token: blue > 0 (the step made it more "
                                "likely), red < 0 (less likely)"),
    "ent": Shading("entropy", "the rollout policy's entropy at each sampled token (nats): darker = less certain"),
    "mis": Shading("sampler/trainer mismatch", "sampler − trainer log-prob of each sampled token (rollout_logprobs − "
                                               "trainer_logprobs): blue > 0, the sampler gave it more probability "
                                               "than the trainer; red < 0, less", floor=0.1),
    "at": Shading("attribution", "each listed token's score in attribution.json (its part of the step's gradient "
                                 "share): blue pushes along the update, red against it; tokens not listed are "
                                 "unshaded"),
}
DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz-_"  # of the token strings (`encode_indexes`)
ERRORS = (OSError, RecordError, ValueError, KeyError, IndexError, TypeError, AttributeError)  # an unusable file


@dataclass(frozen=True)
class SolveShares:
    """How many of a step's groups have every row / no row succeeding (env_metrics `success`)."""

    groups: int
    solve_all: int
    solve_none: int

    def text(self) -> str:
        """`solve-all 1 of 8 groups (12.5%) · solve-none 5 of 8 (62.5%)`."""
        n = self.groups
        return (f"solve-all {self.solve_all} of {n} groups ({_percent(self.solve_all, n)}) · "
                f"solve-none {self.solve_none} of {n} ({_percent(self.solve_none, n)})")


def _percent(k: int, n: int) -> str:
    return f"{k / n:.1%}" if n else "n/a"


@dataclass
class StepView:
    """One recorded step as the browser shows it: the static part and the blob the script builds the groups from."""

    step: int
    reasons: list[str]
    summary: str  # HTML: what was recorded, the histograms, the solve shares, the top replies by attribution
    data: dict[str, Any]  # the JSON blob; its token ids are raw until `index_tokens` encodes them


def browser_section(run_dir: str | Path) -> tuple[str, int] | None:
    """The Samples section built from the run's records and how many steps it shows; None when the run has no
    records (the report then shows a few decoded samples, as it does when none can be read)."""
    paths = records(run_dir)
    if not paths:
        return None
    views, notes, pieces = [], [], {}
    for path in paths:
        try:
            view, note_ = step_view(run_dir, path, pieces)
        except ERRORS as e:
            notes.append(f"{_relative(run_dir, path)}: {str(e).replace(str(path) + ': ', '')}; skipped")
            continue
        views.append(view)
        notes += [note_] if note_ else []
    table = index_tokens(views, pieces)
    head = (f'<h2 id="samples">Samples</h2><p class="meta">The rollout of every recorded step ({RECORDS_DIR}/: '
            "<code>record.every</code>, <code>record.steps</code> and health alarms): every prompt once with all "
            "of its group's replies, token by token. Hover a token for its values; open a group to see its "
            "replies.</p>")
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    body = _browser_html(views, table) if views else ""
    return head + (f'<ul class="bnotes">{notes_html}</ul>' if notes else "") + body, len(views)


def step_view(run_dir: str | Path, path: Path, pieces: dict[int, str]) -> tuple[StepView, str | None]:
    """The view of one record (RecordError or another of `ERRORS` when it is unusable) and a note on its
    attribution file when that one is unusable; adds the record's token pieces to `pieces`."""
    record = RecordedStep.read(path)
    step = record_step(path)
    attribution, attribution_note = read_attribution(run_dir, step, record.rows)
    ok = successes(record)
    data = step_data(step, record, ok, attribution)
    pieces.update(record.pieces)
    reasons = [str(r) for r in record.reasons]
    return StepView(step, reasons, step_summary(step, record, ok, attribution), data), attribution_note


def read_attribution(run_dir: str | Path, step: int, rows: int) -> tuple[dict | None, str | None]:
    """`replays/step_<step>/attribution.json` when it exists (format: `train/replay.py` `attribution_json`), and a
    note when it cannot be used."""
    path = attribution_path(run_dir, step)
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        for r in data["rows"]:
            if not 0 <= int(r["row"]) < rows:
                raise ValueError(f"row {r['row']} is not one of the record's {rows} rows")
        return data, None
    except ERRORS as e:
        return None, f"{_relative(run_dir, path)}: not readable ({e.__class__.__name__}: {e}); not shown"


def _relative(run_dir: str | Path, path: Path) -> str:
    return str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)


def successes(record: RecordedStep) -> np.ndarray:
    """Whether each row succeeded (env_metrics `success` > 0). [N] bool"""
    metrics = record.env_metrics
    if len(metrics) != record.rows:
        raise ValueError(f"env_metrics has {len(metrics)} rows for {record.rows} trajectories")
    return np.array([float(m.get("success", 0.0)) > 0 for m in metrics], dtype=bool)


def group_rows(group_ids: np.ndarray) -> dict[int, list[int]]:
    """Each group's rows, groups in order of first appearance."""
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        out.setdefault(int(g), []).append(i)
    return out


def solve_shares(group_ids: np.ndarray, ok: np.ndarray) -> SolveShares:
    """The groups whose rows all succeed and those where none does."""
    groups = group_rows(group_ids).values()
    return SolveShares(len(groups), sum(bool(ok[r].all()) for r in groups),
                       sum(not ok[r].any() for r in groups))


def mean_advantages(record: RecordedStep) -> np.ndarray:
    """Each kept row's mean advantage over its response tokens (NaN without advantages or response tokens). [M]"""
    kept = record.kept_rows
    if record.advantages is None:
        return np.full(len(kept), np.nan)
    mask = record.response_mask[kept].astype(bool)
    count = mask.sum(axis=1)
    total = np.where(mask, record.advantages, 0.0).sum(axis=1)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def group_means(scores: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Each group's mean trajectory reward, groups in order of first appearance. [G]"""
    return np.array([scores[rows].mean() for rows in group_rows(group_ids).values()])


def fig_step_histograms(scores: np.ndarray, advantages: np.ndarray, means: np.ndarray) -> Figure:
    """Three small histograms of a step: trajectory rewards, kept rows' mean advantages, groups' mean rewards."""
    fig = new_figure(8.4, 1.9)
    panels = ((scores, "trajectory reward", "rows"), (advantages, "mean advantage per kept row", "rows"),
              (means, "mean reward per group", "groups"))
    for ax, (values, title, unit) in zip(fig.subplots(1, 3), panels, strict=True):
        finite = values[np.isfinite(values)]
        left_out = len(values) - len(finite)
        ax.set_title(f"{title} ({len(finite)} {unit}" + (f", {left_out} n/a" if left_out else "") + ")",
                     fontsize=8)
        ax.tick_params(labelsize=7)
        if finite.size == 0:
            note(ax, "none")
            continue
        ax.hist(finite, bins=min(20, np.unique(finite).size), color="#4c78a8", edgecolor="white")
    return fig


def step_summary(step: int, record: RecordedStep, ok: np.ndarray, attribution: dict | None) -> str:
    """The static part of a step: what was recorded, the histograms with the solve shares beside them, the replies
    of largest gradient share."""
    scores, group_ids = record.scores, record.group_ids
    shares = solve_shares(group_ids, ok)
    kept = len(record.kept_rows)
    line = (f"Step {step}, recorded for {_reasons_text(record.reasons)}: {len(scores)} trajectories in "
            f"{shares.groups} groups; the filter kept {kept} rows; {int(ok.sum())} trajectories succeed."
            + _weights_text(record) + _update_text(record.update_steps))
    fig = fig_step_histograms(scores, mean_advantages(record), group_means(scores, group_ids))
    caption = f"Step {step}: trajectory rewards, kept rows' mean advantages, groups' mean rewards"
    shares_html = (f'<div class="bshares"><b>Groups</b><br>{html.escape(shares.text())}<br><span class="meta">'
                   "all rows succeed / no row succeeds (env_metrics success)</span></div>")
    return (f'<p class="meta">{html.escape(line)}</p><div class="bhist">{figure_html(fig, caption, dpi=90)}'
            f"{shares_html}</div>{_top_table(step, attribution, scores, ok)}")


def _reasons_text(reasons: Sequence[str]) -> str:
    return ", ".join(_reason(str(r)) for r in reasons) or "no recorded reason"


def _reason(reason: str) -> str:
    """`alarm:grad_spike` -> `alarm: grad_spike`; `every`, `chosen` as they are."""
    return reason.replace(":", ": ", 1) if reason.startswith("alarm:") else reason


def step_label(step: int, reasons: list[str]) -> str:
    """The selector's entry of a step: `step 37 (alarm: grad_spike)`."""
    return f"step {step} ({_reasons_text(reasons)})"


def _weights_text(record: RecordedStep) -> str:
    pairs = zip(record.reward_names, record.reward_weights, strict=False)
    terms = " + ".join(f"{fmt(float(w))} × {n}" for n, w in pairs)
    return f" Trained reward = {terms}." if terms else ""


def _update_text(steps: Sequence[OptimizerStepRecord] | None) -> str:
    if not steps:
        return " No optimizer step."
    norms = ", ".join(fmt(float(s.grad_norm)) for s in steps)
    counts = {"clipped": sum(s.clipped for s in steps), "skipped": sum(s.skipped for s in steps)}
    flags = [f"{n} {k}" for k, n in counts.items() if n]
    return f" {len(steps)} optimizer step{'s' if len(steps) > 1 else ''}, grad norm {norms}" + (
        f" ({', '.join(flags)})." if flags else ".")


def top_replies(attribution: dict | None) -> list[dict]:
    """The attribution rows of largest |share|, largest first (at most `TOP_REPLIES`)."""
    rows = attribution["rows"] if attribution else []
    return sorted(rows, key=lambda r: -abs(float(r["share"])))[:TOP_REPLIES]


def _top_table(step: int, attribution: dict | None, scores: np.ndarray, ok: np.ndarray) -> str:
    if attribution is None:
        return ""
    cells = "".join(
        f'<tr><td>{rank}</td><td><a class="bjump" href="#br-{step}-{r["row"]}" data-group="{int(r["group"])}">'
        f'row {r["row"]}</a></td><td>{r["group"]}</td><td>{fmt(float(r["share"]))}</td>'
        f"<td>{fmt(_number(r.get('cosine')))}</td><td>{fmt(_number(r.get('norm')))}</td>"
        f"<td>{fmt(float(scores[r['row']]))}</td><td>{'yes' if ok[r['row']] else 'no'}</td></tr>"
        for rank, r in enumerate(top_replies(attribution), 1))
    return (f'<p class="meta">Gradient attribution ({REPLAYS_DIR}/step_{step}/{ATTRIBUTION_FILE}; gradient norm '
            f"{fmt(_number(attribution.get('grad_norm')))}): a reply's share is its part of the step's gradient "
            "along the update (the shares sum to 1; negative pulls against it). The replies of largest |share|:</p>"
            '<table><tr><th>rank</th><th>reply</th><th>group</th><th>share</th><th>cosine</th><th>norm</th>'
            f"<th>reward</th><th>success</th></tr>{cells}</table>")


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


def step_data(step: int, record: RecordedStep, ok: np.ndarray, attribution: dict | None) -> dict[str, Any]:
    """The blob of a step: groups (their prompt, rows and summary line) and rows (tokens from the first response
    token on, response runs, per-token values on the response tokens, reward, advantage, success, kept)."""
    kept = {int(r): k for k, r in enumerate(record.kept_rows.tolist())}
    advantages = mean_advantages(record)
    by_row = {int(r["row"]): r for r in attribution["rows"]} if attribution else {}
    tokens = attribution.get("tokens", {}) if attribution else {}
    ranks = {int(r["row"]): rank for rank, r in enumerate(top_replies(attribution), 1)}
    rows = []
    for i in range(record.rows):
        k = kept.get(i)
        row = reply_data(record, i, k) | {"r": _round(record.scores[i]), "ok": int(ok[i]), "k": int(k is not None),
                                           "a": _round(advantages[k]) if k is not None else None}
        if record.reward_components is not None:
            row["c"] = [_round(v) for v in record.reward_components[i]]
        if i in by_row:
            row |= {"sh": _round(by_row[i]["share"]), "cos": _round(by_row[i].get("cosine"))}
            row |= {"at": [[int(p), _round(v)] for p, v in tokens.get(str(i), [])]}
        if i in ranks:
            row["top"] = ranks[i]
        rows.append(row)
    groups = [group_data(g, members, record, ok, attribution) for g, members in group_rows(record.group_ids).items()]
    return {"step": step, "names": [str(n) for n in record.reward_names], "groups": groups, "rows": rows,
            "open": _first_open(groups, ranks, record.scores), "hasAt": attribution is not None}


def reply_data(record: RecordedStep, i: int, k: int | None) -> dict[str, Any]:
    """Row i's tokens from its first response token to its last attended one (`o`: that first position), the run
    lengths of response and other tokens (`s`, starting with a response run) and the per-token values on its
    response tokens: `adv`, `ent`, `mis` (kept rows only), `lp` (the sampler's log-prob)."""
    attended = np.flatnonzero(record.attention_mask[i])
    response = record.response_mask[i].astype(bool)
    end = int(attended[-1]) + 1 if attended.size else 0
    first = np.flatnonzero(response[:end])
    start = int(first[0]) if first.size else end
    on = response[start:end]
    out: dict[str, Any] = {"i": i, "o": start, "t": record.input_ids[i, start:end].tolist(), "s": run_lengths(on)}
    values = {"lp": _row(record.rollout_logprobs, i)}
    if k is not None:
        values |= {"adv": _row(record.advantages, k), "ent": _row(record.entropy, k)}
        trainer = _row(record.trainer_logprobs, k)
        values["mis"] = values["lp"] - trainer if trainer is not None and values["lp"] is not None else None
    out |= {key: compact(v[start:end][on]) for key, v in values.items() if v is not None}
    return out


def _row(values: np.ndarray | None, i: int) -> np.ndarray | None:
    return values[i] if values is not None else None


def group_data(g: int, members: list[int], record: RecordedStep, ok: np.ndarray,
               attribution: dict | None) -> dict[str, Any]:
    """A group of the blob: its prompt (the attended tokens before the first response token of its first row), its
    rows and its summary line."""
    first = members[0]
    attended = record.attention_mask[first].astype(bool)
    response = np.flatnonzero(record.response_mask[first])
    start = int(response[0]) if response.size else len(attended)
    prompt = record.input_ids[first, :start][attended[:start]].tolist()
    seeds = record.env_seeds
    kept = set(record.kept_rows.tolist())
    parts = [f"group {g}"] + ([f"seed {seeds[first]}"] if first < len(seeds) else [])
    parts += [f"{len(members)} replies", f"mean reward {fmt(float(record.scores[members].mean()))}",
              f"{int(ok[members].sum())} of {len(members)} succeed",
              "kept" if all(r in kept for r in members) else "dropped by the filter"]
    found = [a for a in (attribution or {}).get("groups", []) if int(a["group"]) == g]
    if found:
        parts += [f"share {fmt(float(found[0]['share']))}", f"cosine {fmt(_number(found[0].get('cosine')))}"]
    return {"g": g, "p": prompt, "rows": members, "label": " · ".join(parts)}


def _first_open(groups: list[dict], ranks: dict[int, int], scores: np.ndarray) -> int:
    """The group opened when the step is shown: the one of the top reply by attribution, else the first whose
    rewards differ (whose advantages are not all zero), else the first."""
    top = next((i for i, rank in ranks.items() if rank == 1), None)
    varied = [n for n, g in enumerate(groups) if np.ptp(scores[g["rows"]]) > 0]
    return next((n for n, g in enumerate(groups) if top in g["rows"]), varied[0] if varied else 0)


def run_lengths(mask: np.ndarray) -> list[int]:
    """Lengths of the alternating runs of `mask`, the first counting its leading True values (0 when it starts
    False)."""
    if mask.size == 0:
        return []
    changes = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    runs = np.diff([0, *changes.tolist(), mask.size]).tolist()
    return runs if mask[0] else [0, *runs]


def compact(values: np.ndarray) -> float | None | list[float | None]:
    """Values to 3 significant digits (None for non-finite), one number when they are all the same."""
    out = [_round(v) for v in values.tolist()]
    return out[0] if out and all(v == out[0] for v in out) else out


def _round(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return float(f"{value:.3g}") if np.isfinite(value) else None


def index_tokens(views: list[StepView], pieces: dict[int, str]) -> dict[str, list]:
    """The pieces table of every shown token (most frequent first) with the views' token ids replaced in place by
    their index in it: `{"ids": [token id], "text": [its text decoded alone]}`."""
    counts: Counter[int] = Counter()
    for view in views:
        for item in (*view.data["rows"], *view.data["groups"]):
            counts.update(item.get("t", item.get("p")))
    ids = sorted(counts, key=lambda t: (-counts[t], t))
    index = {t: n for n, t in enumerate(ids)}
    for view in views:
        for row in view.data["rows"]:
            row["t"] = encode_indexes([index[t] for t in row["t"]])
        for group in view.data["groups"]:
            group["p"] = encode_indexes([index[t] for t in group["p"]])
    return {"ids": ids, "text": [pieces.get(t, f"⟨{t}⟩") for t in ids], "digits": DIGITS}


def encode_indexes(indexes: list[int]) -> str:
    """Indexes as one string of base-32 digits, most significant first: a digit from `DIGITS[32:]` is followed by
    more, one from `DIGITS[:32]` ends the number (an index below 32 takes one character, below 1024 two)."""
    out = []
    for n in indexes:
        digits = [DIGITS[n % 32]]
        while n >= 32:
            n //= 32
            digits.append(DIGITS[32 + n % 32])
        out += reversed(digits)
    return "".join(out)


def decode_indexes(text: str) -> list[int]:
    """The inverse of `encode_indexes` (the page's script decodes likewise)."""
    out, n = [], 0
    for char in text:
        digit = DIGITS.index(char)
        if digit >= 32:
            n = n * 32 + digit - 32
        else:
            out.append(n * 32 + digit)
            n = 0
    return out


def json_script(element_id: str, value: Any) -> str:
    """`value` as an inline JSON data block (ASCII; `<`, `>` and `&` escaped so that no text closes the script)."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def _default_step(views: list[StepView]) -> int:
    """The step shown first: the first recorded for a health alarm, else the last."""
    alarmed = [v.step for v in views if any(r.startswith("alarm:") for r in v.reasons)]
    return alarmed[0] if alarmed else views[-1].step


def _browser_html(views: list[StepView], table: dict[str, list]) -> str:
    shown = _default_step(views)
    steps = "".join(f'<option value="{v.step}"{" selected" if v.step == shown else ""}>'
                    f"{html.escape(step_label(v.step, v.reasons))}</option>" for v in views)
    modes = "".join(f'<option value="{key}" data-legend="{html.escape(m.legend)}" data-floor="{m.floor}"'
                    f'{" selected" if key == "adv" else ""}>{html.escape(m.label)}</option>'
                    for key, m in SHADINGS.items())
    blocks = "".join(f'<div class="bstep" id="bstep-{v.step}" hidden>{v.summary}<div class="bgroups"></div>'
                     f'{json_script(f"bdata-{v.step}", v.data)}</div>' for v in views)
    return (f'<div id="browser"><div class="bcontrols"><label>step <select id="bstep">{steps}</select></label>'
            f'<label>shade tokens by <select id="bmode">{modes}</select></label></div>'
            '<p class="meta" id="blegend"></p><noscript><p class="meta">The sample browser needs JavaScript.</p>'
            f'</noscript>{blocks}{json_script("bpieces", table)}<script>{SCRIPT}</script></div>')


CSS = """
.bcontrols { display: flex; gap: 1.5em; margin: 0.6em 0; position: sticky; top: 0; background: #fff; padding: 0.3em 0;
             z-index: 1; } .bcontrols select { font-size: 0.95em; }
.bhist { display: flex; align-items: center; gap: 1.2em; flex-wrap: wrap; } .bhist figure { margin: 0.3em 0; }
.bshares { border: 1px solid #ddd; border-radius: 4px; padding: 0.5em 1em; font-size: 0.9em; }
.bgroup { border: 1px solid #ddd; border-radius: 4px; margin: 0.4em 0; padding: 0.2em 0.6em; }
.bgroup > summary { cursor: pointer; font-size: 0.92em; }
.btok { font-family: monospace; font-size: 0.82em; white-space: pre-wrap; word-break: break-all; line-height: 1.5; }
.bprompt .btok { max-height: 12em; overflow-y: auto; background: #f7f7f7; padding: 0.3em 0.5em; color: #555; }
.breply { border-top: 1px solid #eee; padding: 0.3em 0; } .breply.dropped { opacity: 0.75; }
.bhead { font-size: 0.85em; color: #333; margin-bottom: 0.15em; } .bhead .bok { color: #2e7d32; font-weight: bold; }
.btok .obs { color: #888; } .btok .tok { border-radius: 2px; }
.btop { background: #ffd54f; border-radius: 3px; padding: 0 0.35em; margin-right: 0.5em; font-weight: bold; }
.bnotes { color: #b00; font-size: 0.9em; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  const P = JSON.parse(document.getElementById("bpieces").textContent);
  const stepSel = document.getElementById("bstep"), modeSel = document.getElementById("bmode");
  const legend = document.getElementById("blegend");
  const blobs = {}, built = {}, shown = [], digit = {};
  [...P.digits].forEach((c, k) => { digit[c] = k; });
  function decode(s) {  // encode_indexes' token strings
    const out = [];
    let n = 0;
    for (const c of s) {
      const d = digit[c];
      if (d >= 32) n = n * 32 + d - 32; else { out.push(n * 32 + d); n = 0; }
    }
    return out;
  }
  function blob(step) {
    if (!(step in blobs)) {
      const d = JSON.parse(document.getElementById("bdata-" + step).textContent);
      d.rows.forEach(r => { r.t = decode(r.t); });
      d.groups.forEach(g => { g.p = decode(g.p); });
      blobs[step] = d;
    }
    return blobs[step];
  }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function at(v, j) { return Array.isArray(v) ? v[j] : v; }
  function fmt(v) {
    if (v === null || v === undefined) return "n/a";
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? Number(v).toExponential(2) : String(+Number(v).toPrecision(3));
  }
  function text(ids) { return ids.map(t => P.text[t]).join(""); }
  function attributed(r) {
    if (r.at && !r.atMap) r.atMap = new Map(r.at);
    return r.atMap;
  }
  function value(r, mode, j, pos) {
    if (mode === "at") { const m = attributed(r); return m ? m.get(pos) : undefined; }
    return r[mode] === undefined ? undefined : at(r[mode], j);
  }
  function full(d, mode) {  // the magnitude shaded in full colour: the step's largest, at least the mode's floor
    return Math.max(largest(d, mode), +modeSel.querySelector('option[value="' + mode + '"]').dataset.floor);
  }
  function largest(d, mode) {
    d.scales = d.scales || {};
    if (!(mode in d.scales)) {
      let m = 0;
      for (const r of d.rows) {
        const v = mode === "at" ? (r.at || []).map(p => p[1]) : r[mode];
        if (v !== undefined) for (const x of [].concat(v)) if (x !== null && Math.abs(x) > m) m = Math.abs(x);
      }
      d.scales[mode] = m;
    }
    return d.scales[mode];
  }
  function colour(mode, v, m) {
    if (v === undefined || v === null || !(m > 0)) return "";
    const a = (0.7 * Math.min(1, Math.abs(v) / m)).toFixed(3);
    if (mode === "ent") return "rgba(123,50,148," + a + ")";
    return v >= 0 ? "rgba(33,102,172," + a + ")" : "rgba(214,39,40," + a + ")";
  }
  function tip(r, t, j, pos) {
    const lines = ["position " + pos + " · token " + P.ids[t] + " " + JSON.stringify(P.text[t])];
    if (r.adv !== undefined) lines.push("advantage " + fmt(at(r.adv, j)));
    if (r.ent !== undefined) lines.push("entropy " + fmt(at(r.ent, j)));
    if (r.lp !== undefined) lines.push("sampler log-prob " + fmt(at(r.lp, j)));
    if (r.mis !== undefined) lines.push("mismatch (sampler − trainer log-prob) " + fmt(at(r.mis, j)));
    if (r.at) lines.push("attribution " + (attributed(r).has(pos) ? fmt(value(r, "at", j, pos)) : "not listed"));
    if (!r.k) lines.push("dropped by the filter: not trained");
    return lines.join("\n");
  }
  function tokens(box, d, r) {
    const mode = modeSel.value, m = mode === "none" ? 0 : full(d, mode), out = document.createDocumentFragment();
    let i = 0, j = 0, pos = r.o;
    r.s.forEach((len, n) => {
      const part = r.t.slice(i, i + len);
      i += len;
      if (n % 2) { if (len) out.append(el("span", "obs", text(part))); pos += len; return; }
      for (const t of part) {
        const s = el("span", "tok", P.text[t]);
        s.title = tip(r, t, j, pos);
        const c = colour(mode, value(r, mode, j, pos), m);
        if (c) s.style.background = c;
        out.append(s);
        pos += 1; j += 1;
      }
    });
    box.replaceChildren(out);
  }
  function header(d, r) {
    const h = el("div", "bhead");
    if (r.top) h.append(el("span", "btop", "top " + r.top));
    const parts = ["row " + r.i, "reward " + fmt(r.r)];
    if (r.c) parts.push("(" + d.names.map((n, k) => n + " " + fmt(r.c[k])).join(", ") + ")");
    parts.push(r.k ? "kept, advantage " + fmt(r.a) : "dropped by the filter");
    if (r.sh !== undefined) parts.push("share " + fmt(r.sh), "cosine " + fmt(r.cos));
    h.append(parts.join(" · ") + " · ", el("span", r.ok ? "bok" : "", r.ok ? "success" : "no success"));
    return h;
  }
  function body(det, d, g) {
    if (det.dataset.built) return;
    det.dataset.built = "1";
    const prompt = el("div", "bprompt");
    prompt.append(el("div", "meta", "prompt (" + g.p.length + " tokens; every reply of the group continues it)"),
                  el("div", "btok", text(g.p)));
    det.append(prompt);
    for (const n of g.rows) {
      const r = d.rows[n], reply = el("div", "breply" + (r.k ? "" : " dropped")), box = el("div", "btok");
      reply.id = "br-" + d.step + "-" + r.i;
      reply.append(header(d, r), box);
      det.append(reply);
      tokens(box, d, r);
      shown.push([box, d, r]);
    }
  }
  function groups(step) {
    if (built[step]) return;
    built[step] = true;
    const d = blob(step), box = document.querySelector("#bstep-" + step + " .bgroups");
    d.groups.forEach((g, n) => {
      const det = el("details", "bgroup");
      det.dataset.group = g.g;
      det.append(el("summary", "", g.label));
      det.addEventListener("toggle", () => { if (det.open) body(det, d, g); });
      box.append(det);
      if (n === d.open) { det.open = true; body(det, d, g); }
    });
  }
  function describe() {
    const o = modeSel.selectedOptions[0], d = blob(stepSel.value), top = largest(d, o.value), m = full(d, o.value);
    const at = "; full colour at " + (o.value === "ent" ? "" : "±") + fmt(m);
    legend.textContent = o.dataset.legend + (o.value === "none" ? "" : !(m > 0) ? "; none in this step" :
      at + (m > top ? " (the step's largest is " + fmt(top) + ")" : " (the step's largest)"));
  }
  function showStep() {
    const step = stepSel.value, d = blob(step);
    document.querySelectorAll("#browser .bstep").forEach(e => { e.hidden = e.id !== "bstep-" + step; });
    const attribution = modeSel.querySelector('option[value="at"]');
    attribution.disabled = !d.hasAt;
    if (!d.hasAt && modeSel.value === "at") modeSel.value = "adv";
    groups(step);
    describe();
  }
  stepSel.addEventListener("change", showStep);
  modeSel.addEventListener("change", () => { shown.forEach(([box, d, r]) => tokens(box, d, r)); describe(); });
  document.getElementById("browser").addEventListener("click", e => {
    const a = e.target.closest("a.bjump");
    if (!a) return;
    const det = a.closest(".bstep").querySelector('.bgroup[data-group="' + a.dataset.group + '"]');
    if (det) det.open = true;
    const d = blob(stepSel.value), g = d.groups.find(x => String(x.g) === a.dataset.group);
    if (det && g) body(det, d, g);
    const target = document.getElementById(a.getAttribute("href").slice(1));
    if (target) { e.preventDefault(); target.scrollIntoView(); }
  });
  showStep();
  // a link to a part of the page (report.html#samples) lands on it once this part is built
  window.addEventListener("load", () => {
    const target = location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (target) target.scrollIntoView();
  });
})();
"""
