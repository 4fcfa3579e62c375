"""Post-run health checks over a run's metrics rows: what a researcher should watch, as flags with numbers.

They read only the logged metrics, so they work on any run, also one trained without the health monitor (whose own
alarms, from events.jsonl, lead the report: `timeline.py`, docs/health.md). docs/plots-and-report.md describes the
report's "Post-run checks" section these flags fill.

Each check is a pure function `rows -> list[Flag]`; `health_checks` runs them all. Thresholds are rules of
thumb, stated in the flag text, not hard truths:
- grad norm: non-finite values (error); spikes above 5× the running median of the earlier steps (warning);
- clip fraction: mean `actor/pg_clipfrac` over the last steps outside 10–40 % (above: warning; below: a note —
  with one PPO epoch on fresh rollouts low clipping is expected);
- reward trend: slope of a least-squares line through `critic/score/mean` over steps ≤ 0 (warning);
- falling validation: the last validation success 5 points below the first, or 10 below the best (warning);
- loss swings: std of `actor/pg_loss` above 5× its median magnitude and above 0.1. The policy loss averages ~0
  with normalised advantages, so "std / |mean|" would flag every run; the median magnitude is the robust scale
  and the absolute floor ignores wiggles of a loss that stays near 0;
- zero-variance groups: mean share of groups with zero reward std over the last steps > 50 %, or the mean
  in-group reward std ≈ 0 / fallen below 10 % of its first steps' level (warning); what those groups
  do to the update depends on the run's `algo` settings (its config.yaml): with an entropy or KL
  coefficient on, the regularisers' gradient alone; with both 0, no gradient at all;
- early stops (`early_stopped/*`) and skipped optimizer steps (`actor/skipped_steps` > 0);
- gradient-analysis components whose gradient is exactly zero (`grad_norm/<bucket>/zero_grad/<component>` = 1,
  a note): their cosines are undefined and logged as NaN, which this note explains instead of leaving a gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rldynamics import metric_names as names
from rldynamics.plots.data import as_float, series

SEVERITIES = ("error", "warning", "note")


@dataclass(frozen=True)
class Flag:
    """One finding: `severity` (error | warning | note), a one-line `title`, an explanation and its numbers."""

    check: str
    severity: str
    title: str
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


def _steps_text(steps, limit: int = 10) -> str:
    steps = [int(s) for s in steps]
    head = ", ".join(map(str, steps[:limit]))
    return head + (f", … (+{len(steps) - limit} more)" if len(steps) > limit else "")


def _g(x: float) -> str:
    return f"{x:.4g}"


def check_grad_norm(rows: list[dict[str, Any]], key: str = names.ACTOR_GRAD_NORM, factor: float = 5.0,
                    min_history: int = 3) -> list[Flag]:
    """Non-finite grad norms (error) and spikes above `factor` × the running median of the earlier finite values."""
    steps, v = series(rows, key)
    flags = []
    bad = ~np.isfinite(v)
    if bad.any():
        flags.append(Flag("grad_norm_nonfinite", "error", f"non-finite {key} at {int(bad.sum())} step(s)",
                          "NaN/inf gradient norms: the update of those steps was skipped or corrupted. Look for "
                          "exploding losses, bad advantages (all-equal rewards with std normalisation) or too "
                          "high a lr.",
                          {"steps": _steps_text(steps[bad]), "values": ", ".join(str(x) for x in v[bad][:10])}))
    spikes = []
    for i in range(len(v)):
        history = v[:i][np.isfinite(v[:i])]
        if np.isfinite(v[i]) and history.size >= min_history:
            med = float(np.median(history))
            if med > 0 and v[i] > factor * med:
                spikes.append((int(steps[i]), float(v[i]), med))
    if spikes:
        worst = max(spikes, key=lambda s: s[1] / s[2])
        flags.append(Flag("grad_norm_spike", "warning", f"{key} spikes above {factor:g}× the running median "
                          f"at {len(spikes)} step(s)",
                          "Isolated spikes are usually harmless with clipping; repeated or growing spikes precede "
                          "divergence. Absolute grad-norm values are not comparable across setups.",
                          {"steps": _steps_text(s[0] for s in spikes),
                           "worst": f"step {worst[0]}: {_g(worst[1])} vs running median {_g(worst[2])} "
                                    f"({_g(worst[1] / worst[2])}×)"}))
    return flags


def check_clipfrac(rows: list[dict[str, Any]], key: str = names.PG_CLIPFRAC, last: int = 10,
                   low: float = 0.10, high: float = 0.40) -> list[Flag]:
    """Mean clip fraction over the last `last` steps outside [low, high] (a rule of thumb)."""
    steps, v = series(rows, key)
    fin = v[np.isfinite(v)][-last:]
    if fin.size == 0:
        return []
    mean = float(fin.mean())
    numbers = {"mean over last steps": f"{mean:.1%}", "steps averaged": int(fin.size),
               "rule of thumb": f"{low:.0%}–{high:.0%}"}
    if mean > high:
        return [Flag("clipfrac_high", "warning", f"clip fraction {mean:.1%} is above {high:.0%}",
                     "Rule of thumb: 10–40 % of tokens clipped. Much more means the policy moves far from the "
                     "rollout policy each update (lr, ppo_epochs or mini-batch count too high).", numbers)]
    if mean < low:
        return [Flag("clipfrac_low", "note", f"clip fraction {mean:.1%} is below {low:.0%}",
                     "Rule of thumb: 10–40 %. Low clipping means small policy updates; it is expected with one PPO "
                     "epoch on fresh rollouts, but with a low lr it can mean learning is slow.", numbers)]
    return []


def check_reward_trend(rows: list[dict[str, Any]], key: str = names.SCORE_MEAN, min_points: int = 3) -> list[Flag]:
    """Slope of a least-squares line through the reward over steps; ≤ 0 is flagged."""
    steps, v = series(rows, key)
    ok = np.isfinite(v)
    if ok.sum() < min_points or np.ptp(steps[ok]) == 0:
        return []
    slope, intercept = np.polyfit(steps[ok], v[ok], 1)
    if slope > 0:
        return []
    third = max(1, int(ok.sum()) // 3)
    return [Flag("reward_not_improving", "warning", f"reward is not trending up (slope {_g(slope)} per step)",
                 f"Linear fit of {key} over {int(ok.sum())} steps. Rewards should increase over time; a flat or "
                 "falling reward means the updates do not help (check lr, advantages and the filter).",
                 {"slope per step": _g(float(slope)), "intercept": _g(float(intercept)),
                  "first value": _g(float(v[ok][0])), "last value": _g(float(v[ok][-1])),
                  "mean of first third": _g(float(v[ok][:third].mean())),
                  "mean of last third": _g(float(v[ok][-third:].mean())),
                  "steps": f"{int(steps[ok][0])}–{int(steps[ok][-1])}"})]


def check_loss_swings(rows: list[dict[str, Any]], key: str = names.PG_LOSS, ratio: float = 5.0,
                      min_std: float = 0.1, min_points: int = 5) -> list[Flag]:
    """Policy-loss std above `ratio` × its median magnitude and above `min_std` (wild swings); non-finite losses.

    `min_std` keeps tiny absolute wiggles of a loss that sits at ≈ 0 (normalised advantages) from being flagged.
    """
    steps, v = series(rows, key)
    flags = []
    if (~np.isfinite(v)).any():
        flags.append(Flag("loss_nonfinite", "error", f"non-finite {key} at {int((~np.isfinite(v)).sum())} step(s)",
                          "The loss itself was NaN/inf.", {"steps": _steps_text(steps[~np.isfinite(v)])}))
    ok = np.isfinite(v)
    if ok.sum() < min_points:
        return flags
    x, s = v[ok], steps[ok]
    std, scale = float(x.std()), float(np.median(np.abs(x)))
    if std > min_std and std > ratio * scale:
        i = int(np.argmax(np.abs(x)))
        flags.append(Flag("loss_swings", "warning", f"{key} swings: std {_g(std)} vs typical magnitude {_g(scale)}",
                          f"The loss should not have wild swings. Its std over {x.size} steps is "
                          f"{_g(std / scale) if scale else 'inf'}× its median |value| (thresholds: {ratio:g}× and "
                          f"std > {min_std:g}; std/|mean| is not used since the policy loss averages ≈ 0).",
                          {"mean": _g(float(x.mean())), "std": _g(std), "median |loss|": _g(scale),
                           "largest |loss|": f"{_g(float(x[i]))} at step {int(s[i])}"}))
    return flags


def check_zero_variance(rows: list[dict[str, Any]], num_groups: int | None = None, last: int = 10,
                        max_fraction: float = 0.5, std_eps: float = 1e-3,
                        collapse_ratio: float = 0.1, *, algo: dict[str, Any] | None = None,
                        ) -> list[Flag]:
    """Share of groups with zero reward std (`rollout/filter_zero_count` / groups) and in-group std
    collapse; `algo`: the run's `algo` settings (its config.yaml), which say what those groups do to
    the update."""
    flags = []
    fractions = []
    for r in rows:
        zero = as_float(r.get(names.FILTER_ZERO_COUNT))
        n = float(num_groups) if num_groups else _groups_of_row(r)
        if math.isfinite(zero) and n and math.isfinite(n):
            fractions.append(zero / n)
    recent = np.asarray(fractions[-last:], dtype=float)
    if recent.size and recent.mean() > max_fraction:
        flags.append(Flag("zero_variance_groups", "warning",
                          f"{recent.mean():.0%} of groups have zero reward variance (last {recent.size} steps)",
                          _zero_variance_advice(algo),
                          {"mean share (last steps)": f"{recent.mean():.1%}", "last step share": f"{recent[-1]:.1%}",
                           "groups per step": num_groups or "from filter_kept_count / filter_kept_ratio"}))
    _, std = series(rows, names.IN_GROUP_REWARD_STD)
    std = std[np.isfinite(std)]
    if std.size:
        tail, head = float(std[-last:].mean()), float(std[:last].mean())
        numbers = {"mean in-group reward std (last steps)": _g(tail), "first steps": _g(head)}
        if tail <= std_eps:
            flags.append(Flag("reward_std_zero", "warning", f"in-group reward std ≈ 0 ({_g(tail)})",
                              "Within-group rewards no longer vary: no learning signal for group-relative "
                              "advantages (reward-variance collapse).", numbers))
        elif std.size > last and head > 0 and tail < collapse_ratio * head:
            flags.append(Flag("reward_std_collapse", "warning",
                              f"in-group reward std fell to {tail / head:.0%} of its initial level",
                              f"Below {collapse_ratio:.0%} of the first steps' level: reward-variance collapse "
                              "(RAGEN's early-stop rule).", numbers))
    return flags


REGULARISERS = ("entropy_coef", "kl_coef")  # the `algo` coefficients of the non-task loss terms


def _zero_variance_advice(algo: dict[str, Any] | None) -> str:
    """What equal-reward groups do to the update, by the run's regulariser coefficients (unknown:
    both cases)."""
    head = ("Groups whose samples all get the same reward give no task gradient (group-relative "
            "advantages 0, as in GRPO and RLOO); ")
    tail = (" Raise the temperature or the group size, or filter those groups out "
            "(filter.include_zero=false).")
    if not isinstance(algo, dict) or any(k not in algo for k in REGULARISERS):
        return head + ("they add only the regularisers' gradient (entropy, KL) where their "
                       "coefficients are on." + tail)
    on = [f"algo.{k}={_g(v)}" for k in REGULARISERS
          if isinstance(v := algo.get(k), (int, float)) and v != 0]
    if on:
        return head + (f"they add only the regularisers' gradient ({', '.join(on)}), which can "
                       "then dominate the update." + tail)
    return head + ("with the entropy and KL coefficients both 0, those groups contribute no "
                   "gradient: the update comes from the other groups alone." + tail)


def _groups_of_row(row: dict[str, Any]) -> float:
    kept, ratio = as_float(row.get(names.FILTER_KEPT_COUNT)), as_float(row.get(names.FILTER_KEPT_RATIO))
    return kept / ratio if math.isfinite(kept) and math.isfinite(ratio) and ratio > 0 else math.nan


def val_success_key(rows: list[dict[str, Any]], config: dict[str, Any] | None = None) -> str | None:
    """`val-env/<env.name>/success` of the run (from its config, else the first such key logged; None if none)."""
    env = (config or {}).get("env")
    if isinstance(env, dict) and isinstance(env.get("name"), str):
        return names.val_success(env["name"])
    for row in rows:
        for key in row:
            parsed = names.parse_env_metric(key)  # (validation?, env, metric)
            if parsed and parsed[0] and parsed[2] == names.SUCCESS:
                return key
    return None


def check_val_falling(rows: list[dict[str, Any]], key: str | None, drop_from_start: float = 0.05,
                      drop_from_best: float = 0.10, min_points: int = 3) -> list[Flag]:
    """Validation success that ended `drop_from_start` below its first value or `drop_from_best` below its best
    (absolute; with 512 validation puzzles near 20 % one standard error is about 2 points)."""
    steps, v = series(rows, key) if key else (np.zeros(0), np.zeros(0))
    ok = np.isfinite(v)
    if ok.sum() < min_points:
        return []
    steps, v = steps[ok], v[ok]
    first, last, best = float(v[0]), float(v[-1]), int(np.argmax(v))
    numbers = {"first": f"{first:.1%} (step {int(steps[0])})", "best": f"{v[best]:.1%} (step {int(steps[best])})",
               "last": f"{last:.1%} (step {int(steps[-1])})", "validations": int(v.size)}
    if last <= first - drop_from_start:
        return [Flag("val_falling", "warning", f"validation success fell from {first:.1%} to {last:.1%}",
                     f"The last validation is {first - last:.1%} below the first (threshold {drop_from_start:.0%}): "
                     "training made the policy worse on the fixed validation puzzles. Look at the lr, the KL / "
                     "entropy coefficients and the samples; the best checkpoint is the one to keep.", numbers)]
    if last <= float(v[best]) - drop_from_best:
        return [Flag("val_past_peak", "warning", f"validation success fell {v[best] - last:.1%} below its best",
                     f"It peaked at step {int(steps[best])} and ended {v[best] - last:.1%} lower (threshold "
                     f"{drop_from_best:.0%}): the run went past its best policy.", numbers)]
    return []


def check_early_stop(rows: list[dict[str, Any]]) -> list[Flag]:
    """`early_stopped/<reason>` keys with a true value."""
    hits = [(r.get("step"), reason) for r in rows for k, v in r.items()
            if (reason := names.early_stop_reason(k)) is not None and (not isinstance(v, (int, float)) or v != 0)]
    return [Flag("early_stop", "warning", f"training stopped early: {reason} (step {step})",
                 "The trainer's early-stop rule fired; later steps were not run.", {"step": step, "reason": reason})
            for step, reason in hits]


def check_skipped_steps(rows: list[dict[str, Any]], key: str = names.SKIPPED_STEPS) -> list[Flag]:
    """Steps where optimizer updates were skipped (non-finite gradients)."""
    steps, v = series(rows, key)
    hit = np.isfinite(v) & (v > 0)
    if not hit.any():
        return []
    return [Flag("skipped_steps", "warning", f"optimizer updates skipped at {int(hit.sum())} step(s)",
                 "`actor/skipped_steps` > 0: some mini-batch updates were dropped (non-finite gradients).",
                 {"steps": _steps_text(steps[hit]), "updates skipped in total": _g(float(v[hit].sum()))})]


ZERO_GRADIENT_CAUSES = {
    "kl": "The k3 (low_var_kl) KL gradient is exactly 0 where the policy equals the reference: the first "
          "steps of a run, or a probe of the initial model.",
    "task": "Zero advantages: under GRPO every group of the bucket has zero reward variance.",
    "entropy": "The entropy gradient vanished (a uniform or one-hot predictive distribution).",
}


def check_zero_gradients(rows: list[dict[str, Any]], prefix: str = names.GRAD_NORM) -> list[Flag]:
    """Analysis gradients that are exactly zero (`zero_grad/<component>` = 1), one note per component."""
    where: dict[str, list[tuple[int, str]]] = {}
    for r in rows:
        for k, v in r.items():
            bucket, metric = names.parse_bucket_metric(k, prefix) or ("", "")
            if metric.startswith("zero_grad/") and as_float(v) == 1:
                where.setdefault(metric.split("/", 1)[1], []).append((int(r["step"]), bucket))
    flags = []
    for comp, hits in sorted(where.items()):
        steps = sorted({s for s, _ in hits})
        flags.append(Flag(f"zero_gradient_{comp}", "note",
                          f"the {comp} gradient is exactly zero in {len(hits)} analysed bucket(s)",
                          f"{ZERO_GRADIENT_CAUSES.get(comp, '')} Cosines with a zero gradient are undefined: they "
                          "are logged as NaN (not 0, which would read as orthogonal) and left out of the figures.",
                          {"steps": _steps_text(steps),
                           "buckets": ", ".join(sorted({b for _, b in hits}, key=lambda b: (b != "all", b)))}))
    return flags


def health_checks(rows: list[dict[str, Any]], config: dict[str, Any] | None = None) -> list[Flag]:
    """Every check over the metrics rows, sorted by severity (errors first)."""
    train, algo = (config or {}).get("train"), (config or {}).get("algo")
    flags = [*check_grad_norm(rows), *check_clipfrac(rows), *check_reward_trend(rows),
             *check_val_falling(rows, val_success_key(rows, config)), *check_loss_swings(rows),
             *check_zero_variance(rows, _groups_of(train), algo=_section(algo)),
             *check_early_stop(rows), *check_skipped_steps(rows), *check_zero_gradients(rows)]
    return sorted(flags, key=lambda f: SEVERITIES.index(f.severity))


def _groups_of(train: Any) -> int | None:
    """`train.env_groups` of a config.yaml's `train` section (None unless a positive int)."""
    groups = train.get("env_groups") if isinstance(train, dict) else None
    return groups if isinstance(groups, int) and groups > 0 else None


def _section(section: Any) -> dict[str, Any] | None:
    return section if isinstance(section, dict) else None


def summary_line(flags: list[Flag]) -> str:
    """One sentence summarising the flags ("No issues found." when there are none)."""
    if not flags:
        return "No issues found: none of the health checks fired."
    counts = {s: sum(f.severity == s for f in flags) for s in SEVERITIES}
    parts = [f"{n} {s}{'s' if n > 1 else ''}" for s, n in counts.items() if n]
    if not counts["error"] and not counts["warning"]:
        return f"No issues found (no errors or warnings); {', '.join(parts)}."
    return "Found " + ", ".join(parts) + "."
