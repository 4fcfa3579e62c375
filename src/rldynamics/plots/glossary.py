"""What each health rule and each health signal means, what typically causes it and what to try: the one source of
the glossary that docs/health.md holds (generated into it) and the report's Health section embeds.

`RULES`: rule name (`health.<name>`, `health/<name>`) -> `Entry`, in the order the monitor checks them
(`analysis/health_rules.py`; a test keeps the two tables equal). `SIGNALS`: metric name -> `Entry` for the signals
the monitor logs beside the rules. `markdown()` renders both for docs/health.md, `entry_html` one entry for the
report; `python -m rldynamics.plots.glossary docs/health.md` rewrites the page's glossary block after an edit here.

Text in backticks is a config key, a metric or a file, shown as code. Pure Python: the report imports no torch.
"""

from __future__ import annotations

import html
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from rldynamics import metric_names as names


@dataclass(frozen=True)
class Entry:
    """One glossary entry. `fires`: when the rule fires (for a signal: what it measures); `means`: what that says
    about the run; `causes`: what typically causes it; `tries`: what to try (left out where empty). Sources are named
    in the text."""

    fires: str
    means: str
    causes: str = ""  # empty: the rule the signal feeds says it
    tries: str = ""


GROUP = "<group>"  # a parameter group of `train.update.parameter_group`: embed, layer.<i>, norm, lm_head, other

RULES: dict[str, Entry] = {
    "non_finite": Entry(
        fires="An optimizer step of the actor update had a NaN or infinite gradient norm (the update skips such a "
              "step in any case; `actor/skipped_steps` counts them).",
        means="The loss or its gradient overflowed; that mini-batch taught the policy nothing, and a run of them "
              "means the update has stopped working.",
        causes="A sampled token the trainer gives (almost) zero probability, so its log-prob or importance ratio "
               "explodes (sampler/trainer mismatch, see `mismatch`); bfloat16 overflow in the logits or the loss; "
               "too high a learning rate.",
        tries="Look at `rollout/corr/*` and the step's samples; rerun a few steps with `model.dtype=float32` to see "
              "whether precision is the cause; lower `train.lr`."),
    "first_step": Entry(
        fires="On the first step of a run started from scratch: the first optimizer step's PPO KL "
              "(`actor/ppo_kl`) is above 1e-3 in absolute value, or, with the HF engine (the "
              "trainer's own model samples), the sampler/trainer KL is above "
              "`health.first_step_kl` (5e-3). Both must be ~0 there (bfloat16 rounding alone gives "
              "a sampler/trainer KL of the order of 1e-3).",
        means="The old log-probs and the trainer's log-probs are not computed the same way: a setup bug, not a "
              "training problem. Every later number of the run inherits it.",
        causes="Dropout left on in one of the passes; old log-probs taken from another model, dtype or prompt "
               "format; different padding, masking or chat-template tokenisation between sampling and training.",
        tries="Compare the per-token log-probs of one sample from both passes; make the dtype, the template and the "
              "model mode (eval, no dropout) the same; do not trust the run's curves until this is fixed."),
    "grad_spike": Entry(
        fires="An optimizer step's pre-clip gradient norm is above both `health.grad_spike_factor` "
              "(10) x the median and the median + `health.grad_spike_k` (10) MAD of the last "
              "`health.grad_spike_window` accepted norms (the MAD at least 5 % of the median), "
              "once `health.baseline_steps` norms are known. Optimizer steps without a reward "
              "signal (a mini-batch of groups with equal rewards under GRPO or RLOO: all "
              "advantages 0, a norm ~0) are neither judged nor part of that history. With "
              "`health.grad_spike=skip` the update refuses the spiking optimizer step before it is "
              "taken: the weights and the AdamW state stay as they were; the console says how many "
              "were refused on every step that refused one.",
        means="One mini-batch pushed much harder than the recent ones. Clipping bounds the step's size but not its "
              "direction, which that batch then dominates; repeated or growing spikes precede divergence. "
              "On seed 5 of the default preset the step refused at 12 x the median, let through, doubled the "
              "replies' length (30-43 -> 83-85 tokens) for most of the run; that run still ended higher (25.8 % "
              "against 17.8 %): one seed does not show whether refusing helps.",
        causes="A few tokens with extreme importance ratios (off-policy tokens: Liu, Li et al. 2025, \"When Speed "
               "Kills Stability\", trace collapses with exploding gradient norms to the sampler/trainer mismatch); "
               "a reward outlier; a very long reply under a sum aggregation; too high a learning rate.",
        tries="See which layers spiked (`actor/grad_norm/<group>` at that step) and whether `rollout/corr/*` moved; "
              "read the step's samples; lower `train.lr` or `train.max_grad_norm`; with a mismatch, TIS or MIS "
              "(see `mismatch`)."),
    "entropy_collapse": Entry(
        fires="The rollout policy's entropy (`actor/entropy`) is below "
              "`health.entropy_collapse_ratio` x its start: its mean over the run's first "
              "`health.baseline_steps` steps, up to the first step whose update was damaged (a "
              "non-finite or refused optimizer step, or the `policy_drift` condition: the PPO KL "
              "above `health.drift_kl` or the clipped share above `health.drift_clipfrac`). A "
              "step's entropy is measured before its update, so the later ones already carry the "
              "damage and stay out of the start.",
        means="The policy has become nearly deterministic: it stops exploring, its groups get equal rewards, and "
              "its performance stops improving. Cui et al. 2025 (\"The Entropy Mechanism of Reinforcement Learning "
              "for Reasoning Language Models\") find performance traded against entropy, R = -a exp(H) + b: once "
              "the entropy is spent, the gains stop.",
        causes="Confident tokens with a positive advantage: Cui et al. 2025 derive the step's entropy change as "
               "about -lr x Cov(log pi, A) over the sampled tokens (their natural-gradient form), so a positive "
               "`actor/entropy_cov` drives it down. "
               "Symmetric clipping that keeps unlikely tokens from rising (DAPO, Yu et al. 2025); too high a "
               "learning rate or too many epochs per step.",
        tries="Clip-higher: a larger `algo.clip_high` than `algo.clip_low` (DAPO uses 0.28 and 0.2, the defaults "
              "here); an entropy bonus (`algo.entropy_coef`, sensitive to its value); Cui et al.'s Clip-Cov or "
              "KL-Cov, which restrain the update of the few tokens of highest covariance (not in this trainer); a "
              "higher `train.temperature`; a lower `train.lr`."),
    "reward_variance_collapse": Entry(
        fires="At least `health.zero_variance_share` of the groups had equal rewards (`health/zero_variance_share`, "
              "before the filter) on each of the last `health.zero_variance_steps` steps.",
        means="A group whose replies all score the same has group-relative advantages of 0: no "
              "task gradient. The update then comes from the few groups left, and from the "
              "regularisers when their coefficients are on (`algo.entropy_coef`, `algo.kl_coef`). "
              "RAGEN-2 ties this reward-variance collapse to a task gradient too weak against the "
              "regularisers (see `template_collapse`).",
        causes="Prompts too easy (all succeed) or too hard (all fail) for the current policy; entropy collapse "
               "(the same reply, the same reward); a sparse binary reward; a reward function that always returns "
               "the same value.",
        tries="Tell all-success from all-failure groups (the samples, `train/<env>/success`); dynamic sampling "
              "(DAPO, Yu et al. 2025) drops the equal-reward groups and samples more to keep the batch full, and "
              "the filter here can drop them (`filter.include_zero=false`); a larger `train.group_size` or "
              "`train.temperature`; prompts of a difficulty the policy can still tell apart; a denser reward."),
    "policy_drift": Entry(
        fires="The update's mean PPO KL (`actor/ppo_kl`) is above `health.drift_kl`, or its clipped token share "
              "(low + high, `actor/pg_clipfrac` and `actor/pg_clipfrac_lower`) is above `health.drift_clipfrac`.",
        means="Within one step the policy moved far from the policy that sampled the batch: the clipped objective "
              "ignores many tokens, and the later mini-batches are trained off-policy.",
        causes="Too high a learning rate; too many passes or optimizer steps per batch (`train.ppo_epochs`, a "
               "small `train.mini_batch_size`); large advantages; a sampler that differs from the trainer (see "
               "`mismatch`).",
        tries="Lower `train.lr`; fewer `train.ppo_epochs` or a larger `train.mini_batch_size`; check `mismatch`."),
    "kl_acceleration": Entry(
        fires="With the KL term on (`algo.kl_coef` > 0): the KL to the reference (`actor/kl_loss`) "
              "is above `health.kl_acceleration_min` and grew faster over each of the last 5 steps "
              "(positive first and second differences).",
        means="The policy is running away from the reference model at a growing rate, a common prelude to reward "
              "hacking or to text drifting away from language.",
        causes="A reward the policy has found a way to exploit; a KL coefficient too small for the learning rate; "
               "entropy collapse onto a narrow mode far from the reference.",
        tries="Read the samples for a hack and the reward components for the one that grows; raise "
              "`algo.kl_coef`; lower `train.lr`."),
    "mismatch": Entry(
        fires="The sampler/trainer KL (k3, mean over the trained batch's sampled tokens; `rollout/corr/k3_kl`) is "
              "above `health.mismatch_kl`.",
        means="The engine that sampled the replies gives them other probabilities than the trainer does, so the "
              "\"on-policy\" update is off-policy. Yao, Liu et al. 2025 (\"Your Efficient RL Framework Secretly "
              "Brings You Off-Policy RL Training\") show the gap biases the gradient silently; Liu, Li et al. 2025 "
              "(\"When Speed Kills Stability\") trace training collapses to it.",
        causes="bfloat16 in the sampler or the trainer (different kernels round differently); different dtypes on "
               "the two sides (`rollout.vllm_dtype`, `model.dtype`); weights not synced after an update; sampling "
               "settings applied on one side only.",
        tries="Truncated importance sampling, `algo.tis_cap` (Yao, Liu et al. 2025); sequence masking, "
              "`algo.mis=true` with the band `algo.mismatch_band` (Liu, Li et al. 2025); more precision on both "
              "sides: Qi et al. 2025 (\"Defeating the Training-Inference Mismatch via FP16\") remove most of the "
              "gap with FP16 instead of BF16, and this trainer offers float32 (`model.dtype=float32`, "
              "`rollout.vllm_dtype=float32`). `docs/vllm.md` has the metrics and the corrections."),
    "length_surge": Entry(
        fires="The mean reply length is above `health.length_surge_ratio` x its mean over the run's first "
              "`health.baseline_steps` steps.",
        means="The policy writes much more than it did. That can be learning to reason longer, or rambling, "
              "looping, or a length that the reward pays for.",
        causes="A reward (component) that grows with length; a per-sequence loss average, under which each token "
               "of a long reply weighs less, so long low-quality replies are punished too little (DAPO, Yu et al. "
               "2025, motivate their token-level loss with this); repetition; truncated replies graded as written.",
        tries="Read the samples; check `repetition` and `truncation`; `algo.loss_agg_mode=token-mean` (DAPO's "
              "token-level loss); a length term in the reward, like DAPO's soft overlong punishment."),
    "truncation": Entry(
        fires="More than `health.truncation_rate` of the replies reached `env.max_new_tokens` "
              "(`response_length/clip_ratio`, verl's name; slime logs the same share as `truncated_ratio`).",
        means="Replies are cut off and graded as written, so their rewards say little about the reply: DAPO (Yu et "
              "al. 2025) calls the punishment of a cut reasonable reply reward noise.",
        causes="`env.max_new_tokens` too small for the task; looping or repeating replies; a length surge.",
        tries="Raise `env.max_new_tokens`; check `repetition`; DAPO's overlong filtering (leave truncated replies "
              "out of the loss; not in this trainer) or soft overlong punishment (a length penalty near the "
              "limit)."),
    "repetition": Entry(
        fires="More than `health.repetition_rate` of the replies (of 8 tokens or more) repeat at "
              "least 50 % of their own 4-grams (`health/repetition_rate`; slime logs a like share "
              "as `repetition_frac`).",
        means="Degenerate text: loops, the same phrase again and again, \"!!!!\". Such replies rarely earn a reward "
              "and often hit the length limit.",
        causes="Entropy collapse; a sampler that is off from the trainer (see `mismatch`); too low a sampling "
               "temperature; a reward that does not penalise it; a learning rate high enough to damage the model.",
        tries="Read the samples; check `mismatch` and `entropy_collapse`; a higher `train.temperature`; a lower "
              "`train.lr`; a repetition penalty as a reward component."),
    "reward_component": Entry(
        fires="One weighted reward component carries at least `health.component_takeover` of the "
              "trained reward's variance (`health/reward_share/<component>`), or a component's "
              "share is below `health.component_against` (it moves against the total), the same "
              "finding on each of the last `health.component_steps` steps.",
        means="The advantages are driven by that one component: the policy learns it, not the mix. When the "
              "correctness component takes over because the others saturated, that is fine; when a format or "
              "length component does, the task is not being learned. A negative share fights the total.",
        causes="Component weights out of scale with each other; the other components constant within the groups; "
               "a component that rewards something the others punish.",
        tries="Re-weight with `env.reward_weights.<component>`; see which components vary (`reward/<component>/*`); "
              "their gradients (`analysis.reward_grad=true`, `docs/reward-components.md`)."),
    "template_collapse": Entry(
        fires="With `collapse.enabled`: the first-turn MI estimate between prompt and reply is below "
              "`health.template_mi_drop` x its first value while the entropy holds (at least 80 % of its value "
              "then).",
        means="RAGEN-2's template collapse: the replies stay diverse (the entropy holds) but no longer depend on "
              "the input; the same templates for every prompt. The entropy alone cannot show it.",
        causes="By RAGEN-2's account, updates dominated by prompts of low reward variance: their task gradient is "
               "weak, so input-agnostic terms (regularisers, format) shape the policy.",
        tries="RAGEN-2's filtering by reward variance: train on the groups of highest reward std "
              "(`filter.strategy=top_p`, `filter.metric=reward_std`, `filter.value` below 1); `docs/collapse.md` "
              "has the metrics."),
    "falling_validation": Entry(
        fires="Validation success is more than `health.falling_validation_se` (3) standard errors "
              "of the difference below the run's best, the validation before training included; "
              "each validation's standard error is clustered by problem "
              "(`val-env/<env>/success_se`: a problem drawn several times counts once), binomial "
              "when a validation did not log it.",
        means="The policy got worse on fixed held-out prompts: training now hurts. The best checkpoint is the one "
              "to keep.",
        causes="Entropy collapse, drift, reward hacking or overfitting to the training prompts; whichever other "
               "rule fired just before is the first suspect (the health timeline).",
        tries="Keep the best checkpoint (`checkpoint.every`); lower `train.lr`; address the rule that fired "
              "first."),
    "no_learning": Entry(
        fires="Past `health.no_learning_after` of `train.steps`, no validation so far has been "
              "`health.no_learning_se` (1) standard error of the difference above the first (the "
              "validation before training, when there is one); each standard error clustered by "
              "problem, as for `falling_validation`.",
        means="Half the run (by default) has gone without a measurable gain on the validation "
              "prompts. The bar is one standard error, not two, so that slow learning is not "
              "mistaken for none: the default run was 1.9 standard errors above its start at step "
              "60 of 100 (15.2 % -> 19.7 %) and ended at 24.6 %. A run that gained and then fell "
              "back is `falling_validation`'s, not this rule's (seed 1 of the default: 16.6 % -> "
              "20.7 % at step 20, 18.4 % at 80).",
        causes="No reward signal (`reward_variance_collapse` from the start: all groups fail or all succeed); a "
               "setup bug (`first_step`); a learning rate far too low or too high; a filter that keeps almost "
               "nothing (`rollout/filter_kept_ratio`).",
        tries="Check `reward_variance_collapse`, `first_step` and the kept ratio; easier prompts or a warm start; "
              "a learning-rate sweep (`docs/sweeps.md`)."),
}

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


BEGIN = ("<!-- glossary: generated from src/rldynamics/plots/glossary.py by "
         "`python -m rldynamics.plots.glossary docs/health.md`; edit it there -->")
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
