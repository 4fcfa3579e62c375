"""The health monitor over logged metrics: one plain table per trainer mapping what the rules read
to that trainer's metric names, and the turn of one logged row into `Signals`. Pure Python (no
torch): `rldyn doctor` reads finished runs with it, the TRL callback (`integrations/trl.py`) live
logs.

A table maps a quantity to a metric name; a tuple of names is their sum (all must be logged); a name
ending in "/" is a prefix (one value per name under it); `{env}` stands for the run's environment.
The quantities are fields of `analysis.health_rules.Signals` and these, from which fields are made
(`signals_of`):

- `grad_norm`: the step's pre-clip gradient norm (`Signals.grad_norms`, one norm a step: with
  several optimizer steps a step, rldynamics logs their mean);
- `num_updates`: optimizer steps of the step (with one, the step's PPO KL is its first optimizer
  step's: `Signals.first_ppo_kl`);
- `skipped_steps`: optimizer steps skipped for a non-finite gradient or refused as a spike;
- `advantage_max`, `advantage_min`: both 0 is a step without a reward signal (GRPO's equal-reward
  groups): its norm stays out of the spike history, as the trainer's monitor leaves it out;
- `val_problems`: the validation's distinct problems (its clustered standard error counts from two);
- `score`: the training reward, a curve of the health timeline.

The trainer's own monitor reads its typed results; these tables give it the same numbers where a
step made one optimizer step (`actor/num_updates` 1). TRL's names are those GRPOTrainer 1.16 logs;
transformers' W&B and TensorBoard callbacks log each as `train/<name>` (`HF_PREFIX`)."""

from __future__ import annotations

import math
from typing import Any

from rldynamics import metric_names as names
from rldynamics.analysis.health_rules import RULES, Signals

Table = dict[str, "str | tuple[str, ...]"]  # quantity -> the source's metric name(s)
# quantity -> its value in one row (under a prefix: name -> value)
Values = dict[str, "float | dict[str, float]"]
ENV = "{env}"  # the run's environment in a table's names

RLDYNAMICS: Table = {
    "entropy": names.ENTROPY,
    "zero_variance_share": names.HEALTH_ZERO_VARIANCE_SHARE,
    "grad_norm": names.ACTOR_GRAD_NORM,
    "num_updates": names.NUM_UPDATES,
    "skipped_steps": names.SKIPPED_STEPS,
    "advantage_max": names.advantages("max"),
    "advantage_min": names.advantages("min"),
    "ppo_kl": names.PPO_KL,
    "clipfrac": (names.PG_CLIPFRAC, names.PG_CLIPFRAC_LOWER),
    "kl_ref": names.KL_LOSS,
    "mismatch_kl": names.rollout_corr("k3_kl"),
    "update_kl": names.HEALTH_UPDATE_KL,
    "reply_mean": names.REPLY_MEAN,
    "truncation": names.RESPONSE_CLIP_RATIO,
    "repetition": names.HEALTH_REPETITION_RATE,
    "component_shares": names.health_reward_share(""),
    "mi": names.FIRST_TURN_MI,
    "train_success": names.env_metric(ENV, names.SUCCESS),
    "val_success": names.val_success(ENV),
    "val_se": names.env_metric(ENV, names.SUCCESS_SE, validation=True),
    "val_problems": names.env_metric(ENV, names.PROBLEMS, validation=True),
    "score": names.SCORE_MEAN,
}

# TRL 1.16 GRPOTrainer's `log_history` / `on_log` names (checked by running it). Not logged by it,
# so not here: the PPO KL (`ppo_kl`, `first_ppo_kl`), a sampler/trainer k3 KL (its `sampling/*`
# metrics are log-prob differences and importance ratios), the update's KL on its own batch, the replies' repetition, reward-component
# variance shares, the MI, validation success, skipped optimizer steps.
TRL: Table = {
    "entropy": "entropy",
    "zero_variance_share": "frac_reward_zero_std",
    "grad_norm": "grad_norm",
    "clipfrac": "clip_ratio/region_mean",
    "kl_ref": "kl",
    "reply_mean": "completions/mean_length",
    "truncation": "completions/clipped_ratio",
    "score": "reward",
}

HF_PREFIX = "train/"  # transformers' W&B and TensorBoard callbacks log TRL's x as train/x
# the step of a row in an export: ours and TRL's `step`, W&B's `_step` (its UI's CSV: `Step`), HF's
# global step
STEP_KEYS = ("step", "_step", "Step", "global_step", "train/global_step")

# quantities that are `Signals` fields as they are
DIRECT = ("entropy", "zero_variance_share", "ppo_kl", "clipfrac", "kl_ref", "mismatch_kl", "update_kl",
          "reply_mean", "truncation", "repetition", "mi", "train_success")
MADE_FROM = {"grad_norms": ("grad_norm",), "first_ppo_kl": ("ppo_kl", "num_updates"),
             "non_finite_skips": ("skipped_steps",)}  # a field made of other quantities -> them


def prefixed(table: Table, prefix: str) -> Table:
    """`table` with every name under `prefix` (TRL's names as transformers' W&B / TensorBoard
    callbacks log)."""
    return {q: tuple(prefix + m for m in n) if isinstance(n, tuple) else prefix + n
            for q, n in table.items()}


def number(value: Any) -> float | None:
    """A logged value as a float (NaN and infinities kept); None for what is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def lookup(row: dict[str, Any], name: str | tuple[str, ...], env: str = "") -> Any:
    """The value of one table entry in `row`: a number, a sum, a dict under a prefix; None when not
    logged."""
    if isinstance(name, tuple):
        parts = [number(row.get(n.replace(ENV, env))) for n in name]
        return None if None in parts else sum(parts)
    name = name.replace(ENV, env)
    if name.endswith("/"):
        found = {k[len(name):]: number(v) for k, v in row.items() if k.startswith(name)}
        return {k: v for k, v in found.items() if v is not None} or None
    return number(row.get(name))


def values_of(row: dict[str, Any], table: Table, env: str = "") -> Values:
    """The quantities of `table` logged in `row` (a metrics row: name -> value)."""
    found = {q: lookup(row, name, env) for q, name in table.items()}
    return {q: v for q, v in found.items() if v is not None}


def signals_of(step: int, v: Values, progress: float, val_count: int = 0,
               sampler_is_trainer: bool = True, train_count: int = 0) -> Signals:
    """The `Signals` of one logged step (`progress`: step / the run's steps; `val_count`:
    trajectories of a validation; `train_count`: of a step's rollout), as the trainer's monitor
    builds them from its typed results."""
    x = Signals(step=step, progress=progress, first_step=step == 1,
                sampler_is_trainer=sampler_is_trainer, train_count=train_count)
    for quantity in DIRECT:
        setattr(x, quantity, v.get(quantity))
    x.component_shares = dict(v.get("component_shares", {}))
    _update_fields(x, v)
    if v.get("val_success") is not None:
        x.val_success, x.val_count = v["val_success"], val_count
        x.val_se = v.get("val_se") if v.get("val_problems", 0) >= 2 else None
    return x


def _update_fields(x: Signals, v: Values) -> None:
    """The fields of the actor update that are made of several quantities."""
    norm, skipped = v.get("grad_norm"), v.get("skipped_steps", 0.0)
    no_signal = v.get("advantage_max") == 0 and v.get("advantage_min") == 0
    x.grad_norms = () if norm is None or no_signal else (norm,)
    x.first_ppo_kl = x.ppo_kl if v.get("num_updates") == 1 else None
    finite = norm is None or math.isfinite(norm)
    x.non_finite_skips, x.refused = (0, int(skipped)) if finite else (int(skipped), 0)


def cannot_run(seen: set[str]) -> dict[str, tuple[str, ...]]:
    """rule -> the `Signals` fields it lacks, for the rules that cannot fire on logs with the
    quantities `seen` (a rule needs one field of each of its groups, `Rule.needs`)."""
    out = {}
    for name, rule in RULES.items():
        lacking = [group for group in rule.needs if not any(_has(field, seen) for field in group)]
        if lacking:
            out[name] = tuple(f for group in lacking for f in group)
    return out


def _has(field: str, seen: set[str]) -> bool:
    return all(q in seen for q in MADE_FROM.get(field, (field,)))


def cannot_run_line(seen: set[str]) -> str:
    """One line naming each rule that cannot run and the signal it lacks."""
    lacking = cannot_run(seen)
    if not lacking:
        return "every health rule can run on these logs"
    said = [f"{rule} (no {' or '.join(fields)})" for rule, fields in lacking.items()]
    return f"cannot run on these logs: {', '.join(said)}"


def timeline_row(step: int, v: Values, flags: dict[str, float], env: str = "") -> dict[str, Any]:
    """A metrics row in rldynamics' names for the health report: the quantities with a name of their
    own (the timeline's curves among them) and each rule's `health/<rule>` flag of the step."""
    row: dict[str, Any] = {"step": step}
    for quantity, value in v.items():
        name = RLDYNAMICS.get(quantity)
        if isinstance(name, str) and not name.endswith("/") and (env or ENV not in name):
            row[name.replace(ENV, env)] = value
    row.update({names.health(rule): flag for rule, flag in flags.items()})
    return row
