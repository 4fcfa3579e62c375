"""The names of the metrics a run writes: one owner for the trainer, the probe, the plots, the sweeps and the tests.

Pure Python (no torch): the plots and sweeps read names with it. Every name is `<namespace>/.../<metric>`; the
builders below spell them and the parsers read them back, so a rename here reaches every writer and reader.
Decisions of the trainer never read a metric: the stages return typed values (`train/stages.py`).

- Namespaces of a training row: `rollout/` (the filter's RAGEN names), `actor/`, `critic/`, `response_length/`,
  `train/<env>/` and `val-env/<env>/` (env metrics; `train/batch_size` beside them), `reward/<component>/` and
  `val-reward/<component>/` (reward components of the training batch and of a validation), `reward_stats/`
  (rldynamic's), `timing_s/` (wall time of a phase), `early_stopped/<reason>`, `trainer/`, and of an analysis step
  `grad_norm/<bucket>/...` (`grad_norm_prefilter/` for the unfiltered separate batch), `reward_grad/<bucket>/...`
  and `grad_analysis/`, and of a collapse-diagnosed step `collapse_first_turn_sample/`,
  `collapse_trajectory_sample/` (RAGEN's names) and `collapse/` (their coverage counts).
- Bucket names are RAGEN's: ``bucket_<k>``, k = 1, 2, ... (``docs/reference/ragen_behaviour.md`` §3.4).
  quantile: ``bucket_k`` is the k-th quantile bucket, lowest reward std first; labelled ``Q<k>``.
  fixed_rv: ``bucket_k`` is always the interval [k-1, k) of group reward std (the last one [5, ∞)), also
  when lower intervals are empty, so a name means the same interval at every step and in every run;
  labelled by its interval. Zero bucket (``analysis.zero_bucket``): ``bucket_0`` holds the zero-variance groups,
  labelled ``RV=0``; the other names keep their meaning (quantile buckets of the remaining groups; fixed_rv's
  first interval becomes (0, 1)). ``all`` is the whole batch.
"""

from __future__ import annotations

import math
import re

ROLLOUT = "rollout"  # the training batch's filter metrics
GRAD_ANALYSIS = "grad_analysis"  # the gradient analysis's own bookkeeping (and a separate batch's filter metrics)
GRAD_NORM = "grad_norm"  # per-bucket gradient metrics of the analysed batch
GRAD_NORM_PREFILTER = "grad_norm_prefilter"  # the same of a separate analysis batch before filtering
ALL = "all"  # the whole analysed batch, beside its buckets
REWARD = "reward"  # per-component reward statistics of a rollout
VAL_REWARD = "val-reward"  # the same of a validation's rollouts: `val-reward/<component>/mean|std|zero_std_group_frac`
REWARD_STATS = "reward_stats"  # rldynamic's per-step reward statistics (`rollout.rewards.reward_stats`)
COLLAPSE = "collapse"  # the collapse diagnostics' coverage counts (collapse/first_turn_num_total, ...)
COLLAPSE_FIRST_TURN = "collapse_first_turn_sample"  # their metrics on (first prompt, first reply) pairs
COLLAPSE_TRAJECTORY = "collapse_trajectory_sample"  # ... on trajectory-uniform (prompt, reply) pairs
FIRST_TURN_MI = f"{COLLAPSE_FIRST_TURN}/mi_estimate"  # the first-turn MI estimate (template collapse)
ANALYSIS_PARAMETERS = f"{GRAD_ANALYSIS}/parameters"  # trainable parameters the gradient analysis differentiates

TERM_COMPONENT = {"pg": "task", "entropy": "entropy", "kl": "kl"}  # a loss term of the code -> RAGEN's name in keys
TERM_LOSS = {"pg": "policy", "entropy": "entropy", "kl": "kl"}  # the same in `loss/<name>` keys

ENTROPY = "actor/entropy"  # the rollout policy's entropy (the old-log-prob pass)
PG_LOSS = "actor/pg_loss"  # the actor update's metrics (`train/actor.py`, `train/update.py`): `actor/<stat>`
PG_CLIPFRAC = "actor/pg_clipfrac"
PG_CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"  # the share of tokens held by the dual-clip bound
PPO_KL = "actor/ppo_kl"  # the update's mean PPO KL to the rollout policy
NUM_UPDATES = "actor/num_updates"  # optimizer steps of the update
KL_LOSS = "actor/kl_loss"
ACTOR_GRAD_NORM = "actor/grad_norm"  # pre-clip
SKIPPED_STEPS = "actor/skipped_steps"  # optimizer steps skipped for a non-finite gradient
ACTOR_LR = "actor/lr"
KL_COEF = "actor/kl_coef"
CRITIC_WARMUP = "critic/warmup"  # 1 on a step whose actor update the critic's warm-up skipped
BATCH_SIZE = "train/batch_size"  # rows of the trained (filtered) batch
ENTROPY_COV = "actor/entropy_cov"  # token covariance of the sampled token's log-prob and its advantage
ENTROPY_CHANGE = "actor/entropy_change"  # the rollout policy's entropy minus the previous step's
ENTROPY_CHANGE_SAME_BATCH = "actor/entropy_change_same_batch"  # the batch's entropy after the update minus before
HEALTH = "health"  # the health monitor: `health/<rule>` (1 on a step where it fires) and its signals
IN_GROUP_REWARD_STD = "rollout/in_group_reward_std"
FILTER_KEPT_RATIO = "rollout/filter_kept_ratio"
FILTER_KEPT_COUNT = "rollout/filter_kept_count"
FILTER_ZERO_COUNT = "rollout/filter_zero_count"
EMPTY_AFTER_FILTER = "rollout/empty_after_filter"  # 1 on a step whose filter kept no group
POLICY_VERSION = "rollout/policy_version"  # rollout.staleness: the step whose weights sampled the batch (0: the start)
STALENESS = "rollout/staleness"  # rollout.staleness: updates between those weights and the ones the update starts from
REF_LOG_PROB = "rollout/ref_log_prob"  # mean log-prob of the sampled tokens under the reference
NO_UPDATE_JOB = "trainer/gradient_analysis_only"  # RAGEN's flag: 1 on the row of a job that updates nothing (a probe)
EXITED_AFTER_ANALYSIS = "trainer/exited_after_gradient_analysis"
STEP_TIME = "timing_s/step"
VAL_TIME = "timing_s/val"
EARLY_STOPPED = "early_stopped/"
RECORD_BYTES = "record/bytes"  # the size of the step's record file (`records/step_<N>.safetensors`), recorded steps
SFT_LOSS = "sft/loss"  # `rldyn sft`: the step's NLL per trained (assistant) token, nats
SFT_VAL_LOSS = "sft/val_loss"  # ... the same on the validation puzzles' demonstrations (or sft.data's held-out rows)
SFT_TOKENS = "sft/tokens"  # trained tokens of the step
SFT_PADDING = "sft/padded_share"  # the share of the step's forwarded tokens that are padding
SFT_GRAD_NORM = "sft/grad_norm"  # pre-clip
SFT_LR = "sft/lr"
SFT_EPOCH = "sft/epoch"  # fractional: steps done / steps per epoch


ROLLOUT_CORR = "rollout/corr"  # the sampler/trainer mismatch (verl's `rollout_corr/*` names), `algo.rollout_corr`


def rollout_corr(metric: str) -> str:
    """A sampler/trainer mismatch metric: `rollout/corr/<metric>` (e.g. `k3_kl`, `rollout_is_mean`)."""
    return f"{ROLLOUT_CORR}/{metric}"


def timing(phase: str) -> str:
    """Wall time of a phase of the step: `timing_s/<phase>`."""
    return f"timing_s/{phase}"


def env_prefix(env: str, validation: bool = False) -> str:
    """The namespace of the env metrics of training (`train/<env>`) or validation (`val-env/<env>`) rollouts."""
    return f"{'val-env' if validation else 'train'}/{env}"


def env_metric(env: str, metric: str, validation: bool = False) -> str:
    """An env metric of training (`train/<env>/<metric>`) or validation (`val-env/<env>/<metric>`) rollouts."""
    return f"{env_prefix(env, validation)}/{metric}"


SUCCESS = "success"  # the env metric every env logs: the share of successful trajectories
PROBLEMS = "problems"  # validation: distinct problems (first observations) among its trajectories
SUCCESS_SE = "success_se"  # validation: standard error of success, clustered by problem


def val_success(env: str) -> str:
    """The validation success rate of `env`."""
    return env_metric(env, SUCCESS, validation=True)


def parse_env_metric(key: str) -> tuple[bool, str, str] | None:
    """(validation?, env, metric) of a `train/<env>/<metric>` or `val-env/<env>/<metric>` key; else None."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] in ("train", "val-env"):
        return parts[0] == "val-env", parts[1], parts[2]
    return None


def val_success_env(key: str) -> str | None:
    """The env of a `val_success` key (`val-env/<env>/success`); None for any other key."""
    parsed = parse_env_metric(key)
    return parsed[1] if parsed and parsed[0] and parsed[2] == SUCCESS else None


def early_stopped(reason: str) -> str:
    """The flag of an early stop for `reason`."""
    return f"{EARLY_STOPPED}{reason}"


def early_stop_reason(key: str) -> str | None:
    """The reason of an `early_stopped/<reason>` key; None for any other key."""
    return key[len(EARLY_STOPPED):] if key.startswith(EARLY_STOPPED) else None


def filter_metric(prefix: str, name: str) -> str:
    """A filter metric (`rollout/<name>`; a separate analysis batch's: `grad_analysis/<name>`)."""
    return f"{prefix}/{name}"


def reward_component(component: str, stat: str, prefix: str = REWARD) -> str:
    """A statistic of one reward component: `reward/<component>/<stat>`."""
    return f"{prefix}/{component}/{stat}"


def parse_reward_component(key: str) -> tuple[str, str] | None:
    """(component, stat) of a `reward_component` key; None for any other key."""
    parts = key.split("/")
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == REWARD else None


def bucket_metric(prefix: str, bucket: str, metric: str) -> str:
    """A metric of one analysis bucket: `<prefix>/<bucket>/<metric>` (e.g. `grad_norm/bucket_2/task`)."""
    return f"{prefix}/{bucket}/{metric}"


def parse_bucket_metric(key: str, prefix: str = GRAD_NORM) -> tuple[str, str] | None:
    """(bucket, metric) of a `bucket_metric(prefix, ...)` key whose bucket is `all` or `bucket_<k>`; else None."""
    parts = key.split("/", 2)
    if len(parts) == 3 and parts[0] == prefix and (parts[1] == ALL or bucket_number(parts[1]) is not None):
        return parts[1], parts[2]
    return None


def reward_grad_prefix(prefix: str) -> str:
    """The namespace of the reward-component metrics of an analysis pass (`grad_norm` -> `reward_grad`)."""
    return prefix.replace(GRAD_NORM, "reward_grad")


def actor_grad_norm(component: str) -> str:
    """RAGEN's root copy of the whole batch's gradient norm of a loss component."""
    return f"actor/grad_norm/{component}"


def health(name: str) -> str:
    """`health/<name>`: a health rule's firing flag or a health signal (`train/diagnostics/health.py`)."""
    return f"{HEALTH}/{name}"


HEALTH_ZERO_VARIANCE_SHARE = health("zero_variance_share")  # groups with equal rewards / all groups
HEALTH_REPETITION_RATE = health("repetition_rate")  # replies that repeat their own 4-grams / all replies
HEALTH_UPDATE_KL = health("update_kl_value")  # KL(policy before || after) the actor update, on its own batch


def health_reward_share(component: str) -> str:
    """A reward component's share of the trained reward's variance: `health/reward_share/<component>`."""
    return health(f"reward_share/{component}")


def actor(metric: str) -> str:
    """An actor metric: `actor/<metric>`."""
    return f"actor/{metric}"


def critic(metric: str) -> str:
    """A critic metric: `critic/<metric>` (the critic update's and verl's batch summaries)."""
    return f"critic/{metric}"


def loss(term: str) -> str:
    """The weighted loss of a term in an analysis bucket (RAGEN's `loss/policy|entropy|kl|total`; `TERM_LOSS`)."""
    return f"loss/{term}"


LOSS_TOTAL = loss("total")


# verl's batch summaries (`train/batch_ops.py` `data_metrics`); stat: mean | max | min
def score(stat: str) -> str:
    """A statistic of the trained scores: `critic/score/<stat>`."""
    return critic(f"score/{stat}")


def advantages(stat: str) -> str:
    """A statistic of the advantages over response tokens: `critic/advantages/<stat>`."""
    return critic(f"advantages/{stat}")


def response_length(stat: str) -> str:
    """A statistic of the response lengths in tokens: `response_length/<stat>` (trajectories of the filtered
    batch: mean | max | min; replies of the whole rollout: clip_ratio | reply_mean | reply_max)."""
    return f"response_length/{stat}"


SCORE_MEAN = score("mean")
REPLY_MEAN = response_length("reply_mean")  # sampled tokens per reply of the whole rollout
RESPONSE_LENGTH_MEAN = response_length("mean")
RESPONSE_CLIP_RATIO = response_length("clip_ratio")  # replies that reached env.max_new_tokens / all replies
RETURNS_MEAN = critic("returns/mean")  # with a critic: GAE returns and values over response tokens
RETURNS_VAR = critic("returns/var")
VALUES_MEAN = critic("values/mean")
VF_EXPLAINED_VAR = critic("vf_explained_var")  # 1 - VF_RESIDUAL_VAR / RETURNS_VAR
VF_RESIDUAL_VAR = critic("vf_residual_var")


CLIP_HIT_RATE = "actor/clip_hit_rate"  # share of the update's optimizer steps whose gradient norm was clipped
GROUP_GRAD_NORM = "grad_norm"  # per parameter group: the pre-clip gradient norm, mean over the update's steps
GROUP_GRAD_NORM_CLIPPED = "grad_norm_clipped"  # ... the same after clipping
GROUP_UPDATE_RATIO = "update_ratio"  # ... ||applied change|| / ||weights before the step||


def actor_group(metric: str, group: str) -> str:
    """A per-parameter-group actor metric: `actor/<metric>/<group>`, e.g. `actor/update_ratio/layer.0` (metric: a
    `GROUP_*` name; group: `train.update.parameter_group`'s `embed`, `layer.<i>`, `norm`, `lm_head`, `other`).

    `actor/grad_norm/<group>` shares its namespace with RAGEN's loss-component copies (`actor_grad_norm`: `task`,
    `entropy`, `kl`); the two sets of names never meet."""
    return f"actor/{metric}/{group}"


FIXED_RV_EDGES: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0)  # [0,1), [1,2), ..., [4,5), [5, inf)
ZERO_BUCKET = "bucket_0"
_BUCKET_RE = re.compile(r"^bucket_(\d+)$")


def bucket_name(position: int, zero_bucket: bool = False) -> str:
    """The metric name of the bucket at 0-based `position`: ``bucket_<position + 1>``, or ``bucket_<position>``
    when position 0 is the zero bucket."""
    return f"bucket_{position if zero_bucket else position + 1}"


def bucket_number(bucket: str) -> int | None:
    """k of ``bucket_k``; None for any other name (e.g. ``all``)."""
    m = _BUCKET_RE.match(bucket)
    return int(m.group(1)) if m else None


def fixed_rv_interval(bucket: str) -> tuple[float, float] | None:
    """The reward-std interval [low, high) of a fixed_rv bucket name; None for other names."""
    k = bucket_number(bucket)
    if k is None or not 1 <= k <= len(FIXED_RV_EDGES) + 1:
        return None
    edges = (0.0, *FIXED_RV_EDGES, math.inf)
    return edges[k - 1], edges[k]


def bucket_label(bucket: str, mode: str = "quantile", zero_bucket: bool = False) -> str:
    """Axis label of a bucket: ``RV=0`` (the zero bucket), ``Q3`` (quantile), ``[2, 3)`` (fixed_rv; ``(0, 1)`` for
    the first interval when the zero bucket holds RV = 0); other names unchanged."""
    k = bucket_number(bucket)
    if k is None:
        return bucket
    if k == 0:
        return "RV=0"
    interval = fixed_rv_interval(bucket) if mode == "fixed_rv" else None
    if interval is None:
        return f"Q{k}"
    low, high = interval
    opening = "(" if zero_bucket and low == 0 else "["
    return f"{opening}{low:g}, {'∞' if math.isinf(high) else f'{high:g}'})"
