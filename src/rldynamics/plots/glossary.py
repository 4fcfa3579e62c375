"""What each health rule and each health signal means, what typically causes it and what to try: the glossary that
docs/health.md holds (generated into it) and the report's Health section embeds.

`RULES`: rule name (`health.<name>`, `health/<name>`) -> `Entry`, in the order the monitor checks them, each the
`glossary` of its rule in `analysis/health_rules.py` (written next to the rule's check and settings). `SIGNALS`:
metric name -> `Entry` for the signals the monitor logs beside the rules, written here. `markdown()` renders both for
docs/health.md, `entry_html` one entry for the report; `python -m rldynamics.plots.glossary docs/health.md` rewrites
the page's glossary block after an edit of either.

Text in backticks is a config key, a metric or a file, shown as code. Pure Python: the report imports no torch.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

from rldynamics import metric_names as names
from rldynamics.analysis import health_rules
from rldynamics.analysis.health_rules import Entry

GROUP = "<group>"  # a parameter group of `train.update.parameter_group`: embed, layer.<i>, norm, lm_head, other

# `health.<name>` -> its rule's entry, in the order the monitor checks them
RULES: dict[str, Entry] = {name: rule.glossary for name, rule in health_rules.RULES.items()}

SIGNALS: dict[str, Entry] = {
    names.HEALTH_ZERO_VARIANCE_SHARE: Entry(
        fires="Share of the step's groups whose rewards are all equal, before the filter (slime logs the all-0 and "
              "all-1 shares as `zero_std/*`).",
        means="Those groups give no group-relative advantage. Read by `reward_variance_collapse`, whose entry has "
              "the causes and what to try."),
    names.HEALTH_REPETITION_RATE: Entry(
        fires="Share of the step's replies (of 8 tokens or more) in which at least half of the 4-grams repeat an "
              "earlier 4-gram of the same reply.",
        means="Degenerate, looping text. Read by `repetition`, whose entry has the causes and what to try."),
    names.health_reward_share("<component>"): Entry(
        fires="Each weighted component's share of the variance of the trained reward R: Cov(w_k r_k, R) / Var(R); "
              "the shares sum to 1 (none when R is constant or there is one component).",
        means="Near 1: that component alone sets the advantages. Negative: it moves against the total. Read by "
              "`reward_component`, whose entry has the causes and what to try."),
    names.ENTROPY_COV: Entry(
        fires="Covariance over the trained batch's sampled tokens of the token's log-prob under the rollout policy "
              "and its advantage.",
        means="Cui et al. 2025 derive the entropy change of a policy-gradient step as about -lr x this covariance: "
              "positive (confident tokens rewarded) lowers the entropy, negative raises it. A covariance that stays "
              "positive predicts `entropy_collapse` before it happens.",
        causes="Rewarded replies made of tokens the policy already likes: the normal course of exploitation.",
        tries="Compare with `actor/entropy_change`; see `entropy_collapse` for what restrains it."),
    names.ENTROPY_CHANGE: Entry(
        fires="The rollout policy's entropy (`actor/entropy`) minus the previous step's.",
        means="The realised entropy change, to set beside the change `actor/entropy_cov` predicts; steadily "
              "negative is the way to `entropy_collapse`, whose entry has the causes and what to try."),
    names.RESPONSE_CLIP_RATIO: Entry(
        fires="Share of the rollout's replies (a turn is a reply) that reached `env.max_new_tokens` (verl's name).",
        means="Cut-off replies, graded as written. Read by `truncation`, whose entry has the causes and what to "
              "try."),
    names.actor_group(names.GROUP_GRAD_NORM, GROUP): Entry(
        fires="Pre-clip gradient norm of one parameter group (`embed`, `layer.<i>`, `norm`, `lm_head`, `other`), "
              "mean over the update's optimizer steps (`health.layer_norms`).",
        means="Where the gradient is: a spike of `actor/grad_norm` that sits in one layer (often the embeddings or "
              "the head) is a different problem from one spread over all.",
        causes="Rare tokens (embeddings, head); a layer whose activations grew; see `grad_spike`.",
        tries="Compare the groups at a `grad_spike` step with the steps before it."),
    names.actor_group(names.GROUP_GRAD_NORM_CLIPPED, GROUP): Entry(
        fires="The same after global clipping to `train.max_grad_norm`.",
        means="The gradient the optimizer received; equal to the pre-clip norm on steps that were not clipped."),
    names.actor_group(names.GROUP_UPDATE_RATIO, GROUP): Entry(
        fires="Norm of the change the optimizer step applied to a group over the norm of its weights before the "
              "step, mean over the update's optimizer steps.",
        means="How fast each layer moves relative to its size. There is no universal right value; a layer whose "
              "ratio jumps, or sits orders of magnitude above the others, is being rewritten rather than tuned.",
        causes="The learning rate; AdamW's per-parameter scaling, which makes small-gradient layers move as much "
               "as large-gradient ones.",
        tries="A lower `train.lr`; compare the ratio before and after the trouble on the timeline."),
    names.CLIP_HIT_RATE: Entry(
        fires="Share of the update's optimizer steps whose pre-clip gradient norm exceeded `train.max_grad_norm` "
              "(and was clipped).",
        means="Near 1 on every step: the clipping, not the learning rate, sets the step size, and the gradient's "
              "size stops mattering.",
        causes="`train.max_grad_norm` small for the model's gradients; a learning-rate problem hidden by clipping.",
        tries="Read `actor/grad_norm` against `train.max_grad_norm`; a lower `train.lr` with a higher clip."),
}

LABELS = (("fires", "Fires when"), ("means", "Means"), ("causes", "Typical causes"), ("tries", "What to try"))
SIGNAL_LABELS = (("fires", "Measures"), ("means", "Means"), ("causes", "Typical causes"), ("tries", "What to try"))


def _lines(entry: Entry, labels) -> list[tuple[str, str]]:
    return [(label, getattr(entry, field)) for field, label in labels if getattr(entry, field)]


def markdown() -> str:
    """The glossary as Markdown: one heading per rule (metric `health/<rule>`), then one per signal."""
    out = ["### Rules", ""]
    for rule, entry in RULES.items():
        out += [f"#### `{rule}`", "", f"Metric `{names.health(rule)}`, action `health.{rule}`.", ""]
        out += [f"- **{label}.** {text}" for label, text in _lines(entry, LABELS)] + [""]
    out += ["### Signals", ""]
    for metric, entry in SIGNALS.items():
        out += [f"#### `{metric}`", ""]
        out += [f"- **{label}.** {text}" for label, text in _lines(entry, SIGNAL_LABELS)] + [""]
    return "\n".join(out)


def anchor(name: str) -> str:
    """The HTML id of a glossary entry in the report."""
    return "glossary-" + re.sub(r"[^a-z0-9_-]+", "-", name.lower()).strip("-")


def _code(text: str) -> str:
    """Text escaped for HTML, with `backticks` as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def entry_html(name: str) -> str:
    """One rule's or signal's entry as HTML (empty for a name the glossary does not know)."""
    rule = name in RULES
    entry = RULES.get(name) or SIGNALS.get(name)
    if entry is None:
        return ""
    items = "".join(f"<dt>{label}</dt><dd>{_code(text)}</dd>"
                    for label, text in _lines(entry, LABELS if rule else SIGNAL_LABELS))
    head = f"<code>{html.escape(name)}</code>" + (f" (<code>{html.escape(names.health(name))}</code>)" if rule else "")
    return f'<div class="gloss" id="{anchor(name)}"><b>{head}</b><dl>{items}</dl></div>'


BEGIN = ("<!-- glossary: generated from each rule's `glossary` (src/rldynamics/analysis/health_rules.py) and the "
         "signals of src/rldynamics/plots/glossary.py by `python -m rldynamics.plots.glossary docs/health.md`; "
         "edit them there -->")
END = "<!-- end of the generated glossary -->"


def write_into(page: Path) -> bool:
    """Replace the text between `BEGIN` and `END` in `page` with `markdown()`; returns whether it changed."""
    text = page.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n\n" + markdown() + "\n" + text[end:]
    if new != text:
        page.write_text(new)
    return new != text


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: {'rewritten' if write_into(Path(arg)) else 'up to date'}")
