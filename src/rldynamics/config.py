"""Configuration: one dataclass per pipeline stage, YAML presets, `key=value` overrides.

Design choices:
- Each knob has exactly one default, here, with a docstring under it. Library code reads fields; it
  never does `cfg.get(key, default)`.
- Presets (`presets/*.yaml` in the package) hold only the fields that differ from these defaults.
  Precedence: defaults < preset < YAML file < `key=value` overrides.
- Values mean what the user typed. YAML files and `key=value` overrides are read with every scalar kept as
  a string, and each string is converted by the type of its dataclass field: a string field keeps the text
  (`log.name=no` is "no", `0123` is "0123"), an int is a decimal whole number (`010` is ten), a float is a
  finite number, a bool is true/false, yes/no or on/off, and `null` (or nothing) unsets an optional field.
  Unknown keys, bad values, control characters, a key given twice in one YAML mapping and invalid YAML fail
  before any work with one line naming the key (and close matches) (`ConfigError`). The conversion is driven
  by the field types, so new sections need no parsing code; each field's value check sits with it
  (`one_of` choices, `within` ranges, `config_schema`; collected in `CHOICES` and `RANGES`).
- Choices are plain strings checked against tuples in `validate`; the resolved config is saved as YAML
  in the run directory and can be loaded back with `load_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import typing
import unicodedata
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from rldynamics import ragen_keys
from rldynamics.analysis.health_rules import RULES
from rldynamics.config_schema import HEALTH_ACTIONS, SKIPPABLE, one_of, within
from rldynamics.envs import ENVS
from rldynamics.envs.base import own_reward_names
from rldynamics.envs.reward_funcs import load_reward_funcs
from rldynamics.tracking.files import write_file


class ConfigError(ValueError):
    """A bad config key or value; the message names it and says how to fix it."""


KL_TYPES = tuple(k + s for k in ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs") for s in ("", "+"))
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the LM head


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (`model.lora.*`, peft; docs/lora.md): low-rank updates of a frozen base model."""

    rank: int = within(0, 0)
    """Adapter rank r; 0 = off (full fine-tuning). > 0: only the adapters train (float32, with their AdamW state),
    and the KL reference is the base itself with the adapters switched off. Needs peft: pip install -e '.[lora]'.
    At most the width of the narrowest adapted layer (the smaller of its inputs and outputs; checked
    when the model loads)."""
    alpha: int = within(16, 1)
    """Scale of the adapters' update: alpha / rank x B A (RAGEN's and verl's default 16)."""
    dropout: float = within(0.0, 0, high=1)
    """Dropout on the adapters' input, in the actor update's forwards only (rollouts, old and reference log-probs and
    the gradient analysis see the whole adapters): the update then no longer starts at ratio 1 against the old
    log-probs; masks seeded by (seed, step). 0 = none (the default, as in RAGEN and verl); below 1
    (1 drops every input)."""
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    """Modules that get adapters: [all-linear] = every linear layer but the LM head (peft's choice per architecture:
    q/k/v/o_proj and gate/up/down_proj in Llama and Qwen; a tied LM head is never adapted), or module names such
    as [q_proj, v_proj]."""


@dataclass
class ModelConfig:
    path: str = "tiny"
    """HF model id or local directory; `tiny` = the embedded default model built locally."""
    dtype: str = one_of("auto", "auto", "float32", "bfloat16")
    """Compute dtype: auto | float32 | bfloat16 (mixed precision: weights, gradients and AdamW state stay float32,
    forward and backward run in bfloat16, as verl does). auto = bfloat16 where the device computes it fast (a CUDA GPU
    with bfloat16, a CPU with AMX or AVX512-BF16, measured once), else float32; float32 for the
    tiny model and its checkpoints."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them (less memory, one more
    forward; verl's enable_gradient_checkpointing). Gradients are the same."""
    chat_template: str | None = None
    """Prompt format: null = the tokenizer's own chat template | chatml | path to a Jinja template file."""
    device: str = "auto"
    """Device: auto (cuda if available, else cpu) | cpu | cuda | cuda:N (under torchrun: auto | cuda | cpu)."""
    threads: int = within(0, 0)
    """CPU threads torch computes with; 0 = an exported OMP_NUM_THREADS, else half of the usable cores, at most 4
    (torch's own default, every core, is the slowest choice when other work shares the machine; docs/training.md)."""
    shard: bool = True
    """Under torchrun: FSDP2-shard weights, grads and optimizer state (false: a full replica per rank, grads summed)."""
    warm_start_episodes: int = within(8192, 0)
    """Tiny model only: solver demonstrations (episodes) for the supervised warm start (0 = none)."""
    warm_start_turns: int = within(1, 1)
    """Tiny model only: turns per demonstration episode (1 = many cheap single-state examples)."""
    warm_start_noise: float = within(0.4, 0, high=1)
    """Tiny model only: probability that a demonstrated action is replaced by a random one."""
    warm_start_epochs: int = within(6, 1)
    """Tiny model only: passes over the demonstrations in the warm start."""
    warm_start_lr: float = within(1e-3, 0, inclusive=False)
    """Tiny model only: AdamW learning rate of the warm start."""
    warm_start_seed: int = 0
    """Tiny model only: seed of the warm start (its demonstrations' noise and batch order). The run's `seed` leaves
    it alone, as seeds leave a pretrained model alone: runs that differ only in `seed` start from the same weights."""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TinyConfig:
    """The embedded tiny model (`model.path=tiny`): its architecture. Its warm start: `model.warm_start_*`."""

    hidden_size: int = within(64, 1)
    """Hidden size of the embedded Qwen2-architecture model."""
    layers: int = within(2, 1)
    """Transformer layers."""
    tie_embeddings: bool = True
    """The LM head shares the input embedding matrix (as in Qwen2's small models)."""


@dataclass
class EnvConfig:
    """Keys every env shares; each registered env adds its own section `env.<name>.*` (see `env_config_type`)."""

    name: str = "sokoban"
    """Environment name in `rldynamics.envs.ENVS` (`rldyn envs` lists them with their keys)."""
    max_turns: int = within(5, 1)
    """Turns per episode (one model response per turn)."""
    max_actions_per_turn: int = within(2, 1)
    """Actions executed per turn; extra actions in a response are dropped."""
    max_actions_per_traj: int = within(10, 1)
    """Actions per episode; the episode ends (truncated) when reached."""
    max_new_tokens: int = within(24, 1)
    """Tokens the model may generate per turn."""
    enable_think: bool = False
    """Require `<think>...</think>` before `<answer>...</answer>` (every turn's prompt opens the `<think>`)."""
    open_answer: bool = False
    """Without think: every turn's prompt ends with `<answer>`, put back before parsing (RAGEN's no-think prompt)."""
    format_penalty: float = -0.1
    """Reward component `format_penalty`, added once per malformed turn (0 = no such component)."""
    answer_only: bool = False
    """A reply must end with its `</answer>`: text after it makes the turn malformed (format_penalty; its
    answer still counts). RAGEN tolerates text around the tags; a policy can then learn to write on past it."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Weight of a reward component in the trained score, e.g. env.reward_weights.box=2 (unset: the env's default)."""
    reward_funcs: list[str] = field(default_factory=list)
    """Your reward functions (TRL's reward_funcs signature), each a reward component named after the function,
    weight env.reward_weights.<name> (default 1): [module:function, path/file.py:function]; single-turn envs (math,
    prompts)."""

    def options(self) -> dict[str, Any]:
        """The selected env's own keys as constructor keyword arguments."""
        return dataclasses.asdict(getattr(self, self.name))


def env_config_type() -> type:
    """`EnvConfig` with one section per registered env (`env.sokoban`, `env.frozenlake`, ...).

    Built from the registry each time, so an env registered at run time gets its keys too.
    """
    sections = tuple((name, cls.Config) for name, cls in ENVS.items())
    if sections not in _ENV_TYPES:
        fields = [(name, config, field(default_factory=config)) for name, config in sections]
        _ENV_TYPES[sections] = dataclasses.make_dataclass("EnvConfig", fields, bases=(EnvConfig,))
    return _ENV_TYPES[sections]


_ENV_TYPES: dict[tuple, type] = {}


@dataclass
class TrainConfig:
    steps: int = within(30, 0)
    """Training steps (one rollout + update each)."""
    env_groups: int = within(16, 1)
    """Groups per rollout; the envs of a group share one initial state."""
    group_size: int = within(8, 1)
    """Trajectories per group (grpo and rloo need >= 2: their baseline is the group's other
    replies)."""
    seed_base: int = within(10000, 0)
    """Step s uses env seeds seed_base + env_groups*(s-1) + g (RAGEN's train seeds)."""
    lr: float = within(2e-4, 0)
    """Actor AdamW learning rate."""
    weight_decay: float = within(0.01, 0)
    """Actor AdamW weight decay."""
    ppo_epochs: int = within(1, 1)
    """Passes over the batch per step."""
    mini_batch_size: int = within(32, 1)
    """Sequences per optimizer step."""
    micro_batch_size: int = within(16, 1)
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    max_grad_norm: float = within(1.0, 0, inclusive=False)
    """Global L2 gradient clipping (the pre-clip norm is logged as actor/grad_norm)."""
    optim: str = one_of("adamw_torch_fused", "adamw_torch_fused", "adamw_torch")
    """AdamW's implementation (actor and critic), by Hugging Face Trainer's names: adamw_torch_fused (torch's fused
    kernel, one pass over all parameters: 5x faster per step on SmolLM2-135M on an Intel Xeon; equal to the loop
    within a few float32 ulps per step, bit for bit where MKL runs its AVX2 code) or adamw_torch (the per-parameter
    loop). Their states are alike: a checkpoint resumes under either."""
    temperature: float = within(1.0, 0, inclusive=False)
    """Sampling temperature of training rollouts."""
    shuffle: bool = False
    """Shuffle sequences before splitting into mini-batches (seeded)."""
    shared_prefix: bool = True
    """Forward a prompt shared by a group's trajectories once per micro-batch and pack the rest of the rows without
    padding (update, log-prob passes, analysis; the critic's rows packed alike); false: every row whole, padded
    (docs/benchmarks.md)."""
    row_seeded_sampling: bool = False
    """Every trajectory samples from its own seeded stream: same run on any number of ranks (docs/multi-device.md)."""


@dataclass
class RolloutConfig:
    engine: str = one_of("hf", "hf", "vllm")
    """Generation engine of training and validation rollouts: hf (HF generate) | vllm (vLLM colocated in the
    trainer's process, one per rank under torchrun, weights synced after every optimizer step; needs the vllm extra,
    docs/vllm.md)."""
    vllm_dtype: str = one_of("auto", "auto", "float32", "bfloat16")
    """vllm: the engine's weights and compute dtype, auto | float32 | bfloat16 (auto: model.dtype's rule; the trainer
    keeps model.dtype)."""
    vllm_compile: bool = True
    """vllm: compile the engine's model (vLLM's torch.compile with inductor: fused norms and activations; on a GPU
    also CUDA graphs); false: eager (vLLM's enforce_eager). Compiling costs the engine's start (on CPU about 50 s the
    first time for SmolLM2-135M, about 14 s once cached) and buys generation time at every step (docs/vllm.md)."""
    sync_every: int = within(1, 1)
    """vllm: give the engine the trainer's weights after every N-th step (1 = every step, on-policy, verl's way); N > 1
    samples from weights up to N - 1 steps old (an off-policy setting: the sampler/trainer mismatch that algo.tis_cap
    and algo.mis correct, docs/failure-modes.md). Validation always samples the current weights."""
    staleness: int = within(0, 0, high=8)
    """Off-policy lag N: step t's batch is sampled with the weights after update t - 1 - N (the run's first N steps:
    its starting weights), so it trains on samples exactly N updates old (prime-rl's max_off_policy_steps, here a fixed
    lag rather than a bound, so a run is the same whether or not its rollouts overlap). 0 = on-policy. The sampler is a
    copy of the actor holding the lagged weights; checkpoints keep the N earlier versions (sampler.pt), so a resumed
    run samples exactly what an uninterrupted one would. algo.tis_cap, algo.mis and algo.policy_loss=cispo correct the
    lag as they correct any sampler/trainer mismatch (docs/staleness.md)."""
    overlap: bool = False
    """With rollout.staleness >= 1: step t+1's batch is generated in a second thread while step t's update runs (the
    two take turns otherwise), on the weights staleness says, so the run equals its sequential control bit for bit.
    Needs train.row_seeded_sampling=true (each trajectory draws from its own keyed stream, not the process's RNG)."""
    vllm_kv_cache_gib: float = within(1.0, 0, inclusive=False)
    """vllm: memory reserved for the engine's KV cache (GiB, CPU or GPU); bounds the tokens held at once."""
    vllm_sleep: bool = True
    """vllm on a GPU: the engine sleeps between rollouts (weights offloaded to host memory, KV cache freed), so the
    trainer's passes and update have the GPU's memory; off: both stay resident. No effect on CPU."""


@dataclass
class ValConfig:
    every: int = within(10, 0)
    """Validate every N steps (and after the last step); 0 = never in the loop."""
    before_train: bool = True
    """Validate before the first step (logged at step 0)."""
    env_groups: int = within(256, 1)
    """Validation puzzles (fixed seeds seed_base .. seed_base+env_groups-1)."""
    group_size: int = within(1, 1)
    """Samples per validation puzzle."""
    temperature: float = within(0.5, 0, inclusive=False)
    """Sampling temperature of validation rollouts."""
    seed_base: int = within(123, 0)
    """First validation env seed (RAGEN's)."""
    held_out: float = within(0.0, 0, high=0.9)
    """Share of the env's problems kept for validation alone, split by content (the text of the first observation;
    docs/environments.md): training never sees a validation problem, and val-env/<env>/success_se counts distinct
    problems. 0 = split by seed only (RAGEN); for envs with few problems (1-digit additions: 81) set e.g. 0.25."""


@dataclass
class AlgoConfig:
    adv_estimator: str = one_of("gae", "gae", "grpo", "rloo", "reinforce_pp")
    """gae | grpo | rloo | reinforce_pp."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO)."""
    policy_loss: str = one_of("ppo", "ppo", "cispo", "is")
    """ppo (dual-clip when clip_c is set) | cispo | is (unclipped importance sampling, -ratio x advantage: tinker's
    importance_sampling loss)."""
    old_logprobs: str = one_of("trainer", "trainer", "sampler")
    """Where the ratio's pi_old comes from: trainer (its log-probs before the update, verl's decoupled way: the
    sampler's lag is left to algo.tis_cap / algo.mis) | sampler (the rollout's sampling log-probs, tinker's way and
    verl's bypass mode: the ratio, its clip and cispo's weight span the lag; TIS / MIS then have nothing to correct)."""
    clip_low: float = within(0.2, 0, high=1)
    """Lower clip range (ppo): ratio >= 1 - clip_low, in [0, 1)."""
    clip_high: float = within(0.28, 0)
    """Upper clip range: ratio <= 1 + clip_high (clip-higher); cispo: the IS weight's cap."""
    cispo_clip_low: float | None = within(None, 0, high=1)
    """cispo: lower bound 1 - cispo_clip_low of the IS weight, or null for none (as published)."""
    clip_c: float | None = within(3.0, 1, inclusive=False)
    """Dual-clip constant for negative advantages (> 1), or null to disable."""
    loss_agg_mode: str = one_of("token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm")
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    gamma: float = within(1.0, 0, high=1)
    """Discount factor."""
    lam: float = within(1.0, 0, high=1)
    """GAE lambda."""
    kl_coef: float = within(0.0, 0)
    """KL loss coefficient (a reference model is loaded only when > 0 or when analysis needs it)."""
    kl_type: str = one_of("low_var_kl", *KL_TYPES)
    """k1|kl, k2|mse, k3|low_var_kl, abs; a trailing + = straight-through k2 gradient."""
    entropy_coef: float = 0.001
    """Entropy bonus coefficient."""
    tis_cap: float | None = within(None, 0, inclusive=False)
    """Truncated importance sampling: weight each token's policy loss by min(pi_old / pi_rollout, tis_cap), the
    sampler/trainer mismatch correction (verl's token-level rollout_is; TRL's token_truncate mode with
    vllm_importance_sampling_clip_max); null = off."""
    mis: bool = False
    """Sequence masking: drop from the policy loss each trajectory whose geometric-mean pi_old / pi_rollout lies
    outside [1 / mismatch_band, mismatch_band] (verl's geometric rollout_rs; not TRL's sequence_mask, which tests
    the product of the ratios)."""
    mismatch_band: float = within(2.0, 1, inclusive=False)
    """The band of the mismatch metrics (rollout/corr/*fraction*) and of mis: ratios outside [1/band, band] (> 1)."""

    @property
    def has_critic(self) -> bool:
        """Whether the run learns a value model (a critic): GAE does; GRPO, RLOO and REINFORCE++ are critic-free."""
        return self.adv_estimator == "gae"

    @property
    def group_relative(self) -> bool:
        """Whether a group whose rewards are all equal gets advantages 0: GRPO and RLOO (their
        baseline is the group); GAE's critic and REINFORCE++'s batch whitening give it others."""
        return self.adv_estimator in ("grpo", "rloo")


@dataclass
class CriticConfig:
    lr: float = within(1e-3, 0)
    """Critic AdamW learning rate (GAE only)."""
    clip_range: float = within(0.5, 0, inclusive=False)
    """Value clipping range around the old values."""
    max_grad_norm: float = within(1.0, 0, inclusive=False)
    """Critic gradient clipping."""
    ppo_epochs: int | None = within(None, 1)
    """Passes of the critic over the batch per step (null = train.ppo_epochs)."""
    warmup_steps: int = within(0, 0)
    """The first N steps update only the critic (no actor update, no analysis); RAGEN's trainer.critic_warmup."""


@dataclass
class FilterConfig:
    strategy: str = one_of("top_p", "none", "top_p", "top_k", "top_k_abs", "min_p")
    """none | top_p | top_k | top_k_abs | min_p (whole groups are kept or dropped)."""
    value: float = within(1.0, 0)
    """Strategy parameter (top_p: mass; top_k: fraction of groups; top_k_abs: count; min_p: ratio)."""
    keep: str = one_of("largest", "largest", "smallest")
    """largest | smallest scores are kept."""
    metric: str = one_of("reward_std", "reward_std", "reward_variance", "reward", "reward_mean", "reward_sum",
                          "reward_max")
    """Group score: reward_std | reward | reward_sum | reward_max."""
    prob_mode: str = one_of("linear", "linear", "softmax")
    """top_p: linear | softmax."""
    include_zero: bool = True
    """Keep groups whose score is zero as candidates."""
    loss_scaling: str = one_of("none", "none", "linear", "sqrt")
    """Scale advantages by the kept ratio: none | linear | sqrt."""
    empty_stop_steps: int = 5
    """Stop after this many consecutive steps with an empty filtered batch (<= 0 disables)."""


@dataclass
class AnalysisConfig:
    enabled: bool = False
    """Run the gradient analysis on schedule."""
    every: int = within(10, 1)
    """Analyse at steps 1, 1+every, 1+2*every, ..."""
    num_buckets: int = within(6, 1)
    """Reward-variance buckets."""
    bucket_mode: str = one_of("quantile", "quantile", "fixed_rv")
    """quantile | fixed_rv."""
    zero_bucket: bool = True
    """Zero-variance groups form their own bucket_0 and tied reward stds share a bucket (false: RAGEN's plain split)."""
    per_group: bool = False
    """Differentiate every group alone too: per-group norms in groups.csv, 95 % bootstrap CIs (.../ci_low|ci_high)."""
    bootstrap_resamples: int = within(1000, 1)
    """Bootstrap resamples of the per-group intervals (with per_group)."""
    env_groups: int | None = within(None, 1)
    """Separate analysis batch: groups (null = analyse the training batch)."""
    group_size: int | None = within(None, 1)
    """Separate analysis batch: group size (null = training group size)."""
    exit_after: bool = False
    """End the run right after the first analysis (no update, no checkpoint)."""
    prefilter: bool = False
    """Also analyse the separate analysis batch before filtering."""
    reward_grad: bool = False
    """Also analyse each named reward component's own gradient (reward_grad/<bucket>/*, reward_grad.json)."""
    terms: list[str] = field(default_factory=lambda: ["task", "entropy", "kl"])
    """Loss terms the probe differentiates: any of task, entropy, kl ([] with reward_grad: components only)."""
    dump_gradients: bool = False
    """Write every analysed gradient in full, per parameter, to analysis/step_<N>/gradients.npz (float32; big)."""
    dump_max_pending: int = within(2, 1)
    """Gradient dumps held in memory while a background thread writes them (the step waits beyond this)."""
    memory_chunks: int = within(1, 1)
    """Probe memory: 1 holds every analysed gradient whole (2 x terms float32 copies of the parameters); C > 1
    differentiates the parameters in C chunks, holding ~1/C of that (at least the largest tensor) for C forward passes
    per micro-batch, with the same numbers. One process only."""


@dataclass
class CollapseConfig:
    """RAGEN-2's template-collapse diagnostics (RAGEN's `collapse_detection.*`; docs/collapse.md)."""

    enabled: bool = False
    """Cross-score the training batch's replies under its prompts on schedule: mutual-information proxies
    (collapse_first_turn_sample/*, collapse_trajectory_sample/*). Read-only: training is unchanged."""
    compute_freq: int = within(5, 1)
    """Diagnose at step 1, then at every step divisible by this (RAGEN's schedule)."""
    micro_batch_size: int = within(128, 1)
    """Rows [prompt | reply] per forward of the cross-scoring."""
    first_turn_enabled: bool = True
    """Pairs of (first prompt, first reply), one column per group."""
    multi_turn_enabled: bool = True
    """Trajectory-uniform pairs (a trajectory, then one of its turns; each pair its own column)."""
    num_samples: int = within(64, 0)
    """Pairs per mode (first turn: drawn without replacement; trajectory: with); 0 = all (RAGEN's `all`)."""
    std_eps: float = within(1e-3, 0)
    """Added to the marginal std in the z-scores."""
    ema_decay: float = within(0.9, 0, high=1)
    """EMA decay of the marginal std (`*_ema`)."""
    bootstrap_resamples: int = within(200, 0)
    """Prompt-cluster bootstrap resamples of the MI and retrieval intervals (.../ci_low|ci_high); 0 = none."""


@dataclass
class HealthMonitorConfig:
    """The health monitor's own keys; each rule of `analysis/health_rules.py` adds its action and thresholds (its
    `Config`), and `HealthConfig` holds them all."""

    enabled: bool = True
    """Check the rules after every step and log `health/<rule>` (1 on a step where it fires) and events.jsonl."""
    layer_norms: bool = True
    """Per-layer gradient norms before/after clipping and update-to-weight ratios (actor/grad_norm/<group>, ...)."""
    entropy_after_update: bool = False
    """Measure the entropy of the step's batch again under the updated policy (one more forward, and the
    old-log-prob pass on every step): actor/entropy_change_same_batch, the realised change actor/entropy_cov
    predicts."""
    max_rollbacks: int = within(2, 0)
    """Rollbacks a run may make; a rollback rule firing after that stops the run with the state it would have gone
    back to as its last checkpoint (0: a rollback rule stops at once, leaving the state from before the trouble)."""
    remedy: list[str] = field(default_factory=list)
    """What a rollback changes before the run goes on, each `key=value` or `key*=factor`, applied again at every
    rollback (e.g. [train.lr*=0.5, algo.entropy_coef=0.01]): the learning rates, train.max_grad_norm,
    train.temperature, algo.* (not adv_estimator) and filter.* (RAGEN's filter: filter.strategy=top_p)."""
    snapshot_every: int = within(5, 1)
    """With a rollback rule: keep the state after every snapshot_every-th step in memory (and the state before
    step 1), so a rollback goes back to it without a checkpoint on disk."""
    snapshots: int = within(2, 0)
    """In-memory states kept besides the state before step 1 (the newest)."""
    snapshot_mb: float = within(2048.0, 0)
    """Memory the in-memory states may take in all (weights and optimizer state; 0 = checkpoints only); where not
    all fit, the state before step 1 is kept first (SmolLM2-135M's takes about 1.5 GiB)."""
    baseline_steps: int = within(5, 1)
    """Steps that give a rule its start value (entropy, reply length) or history (gradient norms)."""


# A dataclass lists its bases' fields from the last base to the first: the monitor's keys, then each rule's in the
# order of `RULES` (the order of --help-config and of docs/health.md's Settings table).
_HEALTH_SECTIONS = (*(rule.Config for rule in reversed(RULES.values())), HealthMonitorConfig)


@dataclass
class HealthConfig(*_HEALTH_SECTIONS):
    """The health monitor: rules checked after every step, each with an action (docs/health.md: what each rule
    means, typical causes, what to try, and the runs the default thresholds were measured on). Its keys are flat,
    `health.<key>`: the monitor's own (`HealthMonitorConfig`) and every rule's (`health.grad_spike`,
    `health.grad_spike_factor`, ...: `GradSpike.Config`)."""


@dataclass
class RecordConfig:
    """Step records (`records/step_<N>.safetensors`): what a step trained on, for the report's sample browser,
    `rldyn replay` and `rldyn replay --attribute` (docs/forensics.md)."""

    every: int = within(10, 0)
    """Record every N-th step (0 = none on a schedule)."""
    steps: list[int] = field(default_factory=list)
    """Record these steps too ([37, 38])."""
    on_alarm: bool = True
    """Record every step on which a health rule starts firing."""
    keep_last: int = within(0, 0)
    """Keep only the newest N records, deleting older ones after each write (0 = keep all); those of record.steps
    are always kept."""
    state_before_mb: float = within(256.0, 0)
    """Keep, beside each record, the state its step started from (weights, optimizer, critic, RNG:
    records/step_<N>.before/), so `rldyn replay` starts there instead of training the run again, when that state
    is at most this many MiB (about 12 bytes per trained parameter); 0 = never. The run keeps it in memory from
    step to step and writes it only with a record. One process only."""


@dataclass
class CheckpointConfig:
    every: int = within(0, 0)
    """Save every N steps (and at the end when > 0); 0 = only at the end if save_last."""
    save_last: bool = True
    """Save a checkpoint after the last step."""
    keep_last: int = within(0, 0)
    """Keep only the newest N checkpoints, deleting older ones after each save (0 = keep all)."""
    resume: str | None = None
    """Resume from a checkpoint directory, or `latest` (newest in this run's checkpoints/)."""
    save_merged: bool = False
    """LoRA runs: each checkpoint also holds actor_merged/, the base with the adapters merged in (W + alpha / rank x
    B A, computed into new tensors), which bare AutoModelForCausalLM.from_pretrained loads; a whole model's size."""


@dataclass
class EarlyStopConfig:
    enabled: bool = True
    """Stop on reward-variance collapse, low validation success or repeated empty batches."""
    rv_baseline_steps: int = within(10, 1)
    """Steps that form the reward-std baseline."""
    rv_window: int = within(10, 1)
    """Consecutive steps that must all be below rv_ratio * baseline."""
    rv_ratio: float = within(0.1, 0)
    """Collapse threshold as a fraction of the baseline."""
    val_success_threshold: float = within(0.01, 0, high=1)
    """Validation success below this counts as a low-success validation."""
    val_patience: int = within(5, 1)
    """Consecutive low-success validations that stop the run."""


@dataclass
class LogConfig:
    run_dir: str = "runs"
    """Parent directory of run directories."""
    name: str | None = None
    """Run name (default: <env>_<model>_<time>)."""
    samples_per_step: int = within(4, 0)
    """Decoded trajectories written to samples.jsonl per step."""
    wandb: bool = False
    """Mirror metrics to Weights & Biases (WANDB_MODE=offline works)."""
    wandb_project: str = "rldynamics"
    """W&B project."""
    tensorboard: bool = False
    """Mirror metrics to TensorBoard event files in the run directory."""
    progress: bool = True
    """Show the rich progress bar and per-step summaries."""
    report: bool = True
    """Write plots/ and report.html into the run directory at the end of training."""


@dataclass
class SftConfig:
    """`rldyn sft`: supervised fine-tuning on demonstrations before RL (docs/sft.md). Steps, checkpoints and logs
    take `checkpoint.*` and `log.*`; the model `model.*`; validation `val.*` (the trainer's held-out puzzles)."""

    data: str | None = None
    """Conversations in TRL's format (a `messages` list of {role, content} per row): a .jsonl or .parquet file or a
    `datasets` save_to_disk directory. null = demonstrations played by the env's own solver (`sft.episodes`)."""
    episodes: int = within(1000, 1)
    """Solver demonstrations: episodes of `env.max_turns` turns on training puzzles (never a validation puzzle)."""
    noise: float = within(0.0, 0, high=1)
    """Probability that a demonstrated action is replaced by a random one: a weaker warm start (0 = optimal play)."""
    epochs: int = within(1, 1)
    """Passes over the demonstrations."""
    lr: float = within(2e-5, 0, inclusive=False)
    """AdamW learning rate (constant; no weight decay; gradients clipped at norm 1, as TRL's SFTTrainer)."""
    batch_size: int = within(8, 1)
    """Rows per optimizer step: packed rows of `sft.max_length` tokens (sft.packing), else conversations."""
    micro_batch_size: int = within(1, 1)
    """Rows per forward/backward (gradient accumulation inside a step; the loss is the step's token mean)."""
    max_length: int = within(1024, 8)
    """Tokens per packed row; a longer conversation is refused (raise it)."""
    packing: bool = True
    """Pack conversations into rows of `sft.max_length` tokens: position ids restart per conversation and attention
    never crosses one, so no compute goes to padding (false: one padded row per conversation)."""
    val_every: int = within(0, 0)
    """Validate every N steps (loss on the validation puzzles' demonstrations, and the env's success); 0 = before
    the first step and after the last only."""
    success: bool = True
    """Measure the env's success on the validation puzzles (the trainer's validation stage) when validating."""


@dataclass
class Config:
    seed: int = within(0, 0)
    """Seed of model init, sampling and shuffling."""
    model: ModelConfig = field(default_factory=ModelConfig)
    tiny: TinyConfig = field(default_factory=TinyConfig)
    env: EnvConfig = field(default_factory=lambda: env_config_type()())
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    val: ValConfig = field(default_factory=ValConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    record: RecordConfig = field(default_factory=RecordConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    log: LogConfig = field(default_factory=LogConfig)




def _field_checks(kind: str, obj: Any = None, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> the `kind` check ("choices" or "range") of every field that has one, sections recursively."""
    obj = Config() if obj is None else obj
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_field_checks(kind, value, f"{prefix}{f.name}."))
        elif kind in f.metadata:
            out[f"{prefix}{f.name}"] = f.metadata[kind]
    return out


CHOICES: dict[str, tuple[str, ...]] = _field_checks("choices")  # key -> allowed values (`one_of`)
# Ranges, checked after the types (every float is already finite, every int a whole number).
# key -> (lowest allowed, lowest is allowed itself, highest allowed or None) (`within`)
RANGES: dict[str, tuple[float, bool, float | None]] = _field_checks("range")
# Old keys, so that an old config.yaml (a run's, a checkpoint's) and old commands still work, each with a one-line note:
# renamed keys are read at their new place, retired ones (no longer settings) say what replaced them.
RENAMED: dict[str, str] = {
    "model.tiny_hidden_size": "tiny.hidden_size",
    "model.tiny_layers": "tiny.layers",
    "model.tiny_tie_embeddings": "tiny.tie_embeddings",
}
RETIRED: dict[str, str] = {
    "analysis.only": "probe mode is its own command, `rldyn probe <checkpoint>`",
}
DEVICE = re.compile(r"auto|cpu|mps|cuda(:[0-9]+)?")
MAX_INT = 2**63 - 1  # seeds and sizes end up in torch / numpy int64

_NULL = ("null", "Null", "NULL", "~", "")
_BOOL = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
_INT = re.compile(r"[+-]?[0-9]+")


def preset_names() -> list[str]:
    """Names of the presets shipped with the package."""
    files = resources.files("rldynamics") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def preset_dict(name: str) -> dict[str, Any]:
    """The raw contents of a shipped preset (ConfigError naming the presets when there is none of that name)."""
    names = preset_names()
    if name not in names:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(names)}{_suggest(name, names)}")
    return _read_yaml((resources.files("rldynamics") / "presets" / f"{name}.yaml").read_text(), f"preset {name!r}")


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def all_keys(obj: Any = None, prefix: str = "") -> list[str]:
    """Every dotted config key, e.g. `train.lr`."""
    obj = Config() if obj is None else obj
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


# ---------------------------------------------------------------- reading what the user typed


class _RawLoader(yaml.BaseLoader):
    """YAML whose scalars stay the strings that were typed (`no` is "no", `0123` is "0123"); a key given twice
    in one mapping is an error instead of silently replacing the first."""

    def construct_mapping(self, node, deep=False):
        seen: set[str] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str):
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice",
                                                            key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(text: str, source: str) -> Any:
    """Parse YAML text with every scalar kept as a string; errors become one-line ConfigErrors naming `source`."""
    try:
        return yaml.load(text, Loader=_RawLoader)  # noqa: S506 (BaseLoader builds only str, list and dict)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{source} is not valid YAML: {problem}{where}") from None


def _check_text(text: str, what: str) -> None:
    """Reject control characters and unpaired surrogates (undecodable bytes) in keys and values."""
    bad = next((c for c in text if unicodedata.category(c) in ("Cc", "Cs")), None)
    if bad is not None:
        raise ConfigError(f"{what} contains {bad!r} (a control character or an undecodable byte); remove it")


def split_override(item: str) -> tuple[str, str]:
    """`"train.lr=1e-5"` -> `("train.lr", "1e-5")`, the value as typed; Hydra's `+key=` / `++key=` mean `key=`."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if key.startswith("~"):
        raise ConfigError(f"override {item!r}: Hydra deletions (~key) are not supported; set the key instead")
    key = key[2:] if key.startswith("++") else key[1:] if key.startswith("+") else key
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=1e-5)")
    _check_text(key, f"override key {key!r}")
    _check_text(raw, f"value of {key}")
    if "" in key.split("."):
        raise ConfigError(f"override key {key!r} has an empty part; write section.key=value (e.g. train.lr=1e-5)")
    return key, raw


def _translated(overrides: list[str]) -> ragen_keys.Translation:
    """The overrides as `(our key, value)` pairs, RAGEN / verl keys translated (`rldynamics.ragen_keys`).

    Our own keys keep the raw text; a RAGEN key's value is read as YAML first, as Hydra reads it.
    """
    pairs = [split_override(item) for item in overrides]
    try:
        return ragen_keys.translate([(key, _ragen_value(raw) if ragen_keys.lookup(key) else raw) for key, raw in pairs])
    except ragen_keys.UnsupportedKey as e:
        raise ConfigError(str(e)) from e


def _ragen_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw  # the rule that reads it names the bad value


def ragen_translation(overrides: list[str]) -> list[str]:
    """One line per RAGEN / verl key among `overrides`: what it became (the CLI prints these once)."""
    return _translated(overrides).lines


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn `["train.lr=1e-5", "log.name=no"]` into a nested dict of the raw value strings.

    Values are not interpreted here: each is converted by the type of its config field when merged, so a
    string field keeps exactly what was typed. A later override of the same key wins. RAGEN / verl keys
    (`actor_rollout_ref.rollout.rollout_filter_value=0.9`, ...) are translated to ours first.
    """
    nested: dict[str, Any] = {}
    for key, raw in _translated(overrides).pairs:
        parts = key.split(".")
        node = nested
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                scalar = ".".join(parts[: depth + 1])
                raise ConfigError(f"{key}: {scalar} is a value, not a section; set {scalar}=... instead")
        if isinstance(node.get(parts[-1]), dict):
            sub = next(iter(node[parts[-1]]), "")
            raise ConfigError(f"{key} is given both a value and sub-keys ({key}.{sub}=...); give one of them")
        node[parts[-1]] = raw
    return nested


def _merge(base: Any, data: Any, source: str, prefix: str = "") -> Any:
    """A copy of the dataclass `base` with `data` (nested dicts of raw strings) converted and merged in."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of config keys{_at(prefix)}, got {_shown(data)}")
    if not prefix:
        data = _renamed(data, source)
    known = {f.name: f for f in dataclasses.fields(base)}
    hints = typing.get_type_hints(type(base))
    changes = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in RETIRED:
            _retire(dotted, value, source)
            continue
        if key not in known:
            raise ConfigError(f"unknown config key {dotted!r} in {source}{_suggest(dotted, all_keys())}")
        current = getattr(base, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                example = f"{dotted}.{dataclasses.fields(current)[0].name}"
                raise ConfigError(f"{dotted} is a section, not a value, in {source}; set its keys (e.g. {example}=...)")
            changes[key] = _merge(current, value, source, f"{dotted}.")
        else:
            changes[key] = _convert(value, hints[key], dotted, source, current)
    return dataclasses.replace(base, **changes)


def _renamed(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`data` with the `RENAMED` keys moved to their new place (a value given at the new place wins)."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for old, new in RENAMED.items():
        section, key = old.split(".")
        if not isinstance(data.get(section), dict) or key not in data[section]:
            continue
        value = data[section].pop(key)
        new_section, new_key = new.split(".")
        target = data.setdefault(new_section, {})
        if isinstance(target, dict):
            target.setdefault(new_key, value)
        _note(f"note: {old} in {source} is now {new}; read as {new}")
    return data


def _note(line: str) -> None:
    """Print a note about an old key once per process (a run reads its config.yaml more than once)."""
    if line not in _NOTED:
        _NOTED.add(line)
        print(line, file=sys.stderr)


_NOTED: set[str] = set()


def _retire(key: str, value: Any, source: str) -> None:
    """A `RETIRED` key: ignored with a one-line note, except where ignoring it would do something else than asked
    (`analysis.only=true` would train instead of probing)."""
    if key == "analysis.only" and _BOOL.get(str(value).strip().lower()):
        raise ConfigError(f"analysis.only=true in {source}: {RETIRED[key]}, which writes its own run directory; "
                          "drop the key")
    _note(f"note: {key} in {source} is no longer a setting ({RETIRED[key]}); ignored")


def _at(prefix: str) -> str:
    return f" under {prefix[:-1]}" if prefix else ""


def _shown(value: Any) -> str:
    return f"{value!r}" if isinstance(value, str) else f"a {type(value).__name__}"


def _convert(value: Any, hint: Any, key: str, source: str, current: Any = None) -> Any:
    """The value of field `key` (type `hint`) that the raw `value` spells; ConfigError naming the key if none."""
    if hint is Any:
        return _free_value(value, key)
    args = typing.get_args(hint)
    if type(None) in args:  # X | None: the YAML null spellings (and an empty value) mean None
        if value is None or (isinstance(value, str) and value.strip() in _NULL):
            return None
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    if origin in (list, dict):
        return _convert_container(value, hint, key, source, current)
    if isinstance(value, dict):
        sub = next(iter(value), "")
        raise ConfigError(f"{key}.{sub}: {key} is a value, not a section, in {source}; set {key}=... instead")
    if isinstance(value, list):
        raise ConfigError(f"{key} in {source}: expected a single value, got a list")
    if not isinstance(value, str):  # values built in Python rather than typed
        value = str(value).lower() if isinstance(value, bool) else str(value)
    _check_text(value, f"value of {key}")
    return _convert_scalar(value, hint, key, source)


def _free_value(value: Any, key: str) -> Any:
    """A value of any type (`dict[str, Any]`: keyword arguments passed on to a library): each
    typed text read as YAML (`false` a bool, `8x8` a string, `[SFFF, FHFH]` a list), lists and
    mappings item by item."""
    if isinstance(value, dict):
        return {str(k): _free_value(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_free_value(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    _check_text(value, f"value of {key}")
    try:
        return yaml.safe_load(value) if value.strip() else value
    except yaml.YAMLError:
        return value  # not YAML: the text as typed


def _convert_scalar(raw: str, hint: Any, key: str, source: str) -> Any:
    text = raw.strip()
    if hint is str:
        if not raw:
            raise ConfigError(f"{key} in {source} is empty; give a value")
        return raw
    if hint is bool:
        if text.lower() in _BOOL:
            return _BOOL[text.lower()]
        raise ConfigError(f"{key}={raw!r} in {source}: expected a boolean (true / false, yes / no, on / off)")
    if hint is int:
        if not _INT.fullmatch(text) or abs(int(text)) > MAX_INT:
            raise ConfigError(f"{key}={raw!r} in {source}: expected a whole number such as 10")
        return int(text, 10)  # decimal, also with leading zeros: 010 is ten
    if hint is float:
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{key}={raw!r} in {source}: expected a finite number such as 0.001")
        return number
    raise ConfigError(f"{key}: fields of type {hint} cannot be set from text")  # a schema without a converter


def _convert_container(value: Any, hint: Any, key: str, source: str, current: Any) -> Any:
    """list[X] (replaced) and dict[str, X] (merged key by key: `section.weights.a=2` keeps the other weights)."""
    if isinstance(value, str):
        _check_text(value, f"value of {key}")
        value = _read_yaml(value, f"value of {key}")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={_shown(value)} in {source}: expected a list such as [6, 6]")
        return [_convert(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={_shown(value)} in {source}: expected a mapping such as {{name: 1.0}}")
    merged = dict(current or {})
    for k, v in value.items():
        _check_text(str(k), f"key of {key}")
        merged[str(k)] = _convert(v, args[1], f"{key}.{k}", source)
    return merged


def validate(cfg: Config) -> Config:
    """Check choices and ranges; raise ConfigError naming the key and the allowed values."""
    _validate_fields(cfg)
    apply_remedy(cfg)  # each change names a key a rollback may change, with a value it can take
    return cfg


def _validate_fields(cfg: Config) -> Config:
    """`validate` but the health remedy (which applies its changes through this check)."""
    if cfg.model.dtype == "float16":
        raise ConfigError("model.dtype=float16 is not supported: float16 training needs loss scaling, which rldynamics "
                          "does not do; use model.dtype=bfloat16 (float32 weights, bfloat16 compute)")
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
    for key, (low, inclusive, high) in RANGES.items():
        value = _get(cfg, key)
        if value is not None and not ((value >= low if inclusive else value > low) and (high is None or value <= high)):
            bound = f">= {low}" if inclusive else f"> {low}"
            what = "a positive integer" if (low, inclusive) == (1, True) else bound
            raise ConfigError(f"{key} must be {what}{f' and <= {high}' if high is not None else ''}, got {value}")
    if not DEVICE.fullmatch(cfg.model.device):
        raise ConfigError(f"model.device={cfg.model.device!r} is not a device; use auto, cpu, cuda, cuda:N or mps")
    unknown = sorted(set(cfg.analysis.terms) - {"task", "entropy", "kl"})
    if unknown:
        raise ConfigError(f"analysis.terms has unknown terms {unknown}; choose from task, entropy, kl")
    if not cfg.analysis.terms and not cfg.analysis.reward_grad:
        raise ConfigError("analysis.terms=[] leaves nothing to analyse; list terms or set analysis.reward_grad=true")
    skipping = [k for k, allowed in CHOICES.items() if allowed == HEALTH_ACTIONS and k not in SKIPPABLE
                and _get(cfg, k) == "skip"]
    if skipping:
        raise ConfigError(f"{skipping[0]}=skip: only {' and '.join(SKIPPABLE)} can skip (their trouble is found "
                          "before the optimizer step is taken); choose record, warn, rollback or stop")
    _validate_lora(cfg)
    _validate_algo(cfg)
    _validate_staleness(cfg)
    bad_steps = [n for n in cfg.record.steps if n < 1]
    if bad_steps:
        raise ConfigError(f"record.steps={cfg.record.steps} holds {bad_steps[0]}: steps are numbered from 1")
    _validate_env(cfg.env)
    return cfg


def _validate_lora(cfg: Config) -> None:
    """The LoRA keys: targets given, and no setting the adapters cannot honour yet."""
    lora = cfg.model.lora
    if not lora.target_modules:
        raise ConfigError(f"model.lora.target_modules=[] adapts nothing; give module names or [{ALL_LINEAR}]")
    if ALL_LINEAR in lora.target_modules and len(lora.target_modules) > 1:
        raise ConfigError(f"model.lora.target_modules={lora.target_modules}: {ALL_LINEAR} already names every linear "
                          f"layer; give [{ALL_LINEAR}] alone or module names alone")
    if cfg.checkpoint.save_merged and lora.rank == 0:
        raise ConfigError("checkpoint.save_merged=true needs model.lora.rank > 0 (a full fine-tuning checkpoint's "
                          "actor/ is a whole model already)")
    if lora.dropout >= 1:
        raise ConfigError(f"model.lora.dropout={lora.dropout} drops every adapter input, so every "
                          "gradient is 0; give a value in [0, 1)")


GROUP_RELATIVE = ("grpo", "rloo")  # their baseline: the other replies to the same prompt


def _validate_algo(cfg: Config) -> None:
    """Settings the estimator and the policy loss cannot honour: a group-relative baseline over one
    reply, a lower clip that leaves the ratio no lower bound."""
    estimator = cfg.algo.adv_estimator
    for key in ("train.group_size", "analysis.group_size"):
        if estimator in GROUP_RELATIVE and _get(cfg, key) == 1:
            raise ConfigError(f"{key}=1 with algo.adv_estimator={estimator}: a group-relative "
                              f"baseline needs >= 2 replies per prompt; set {key} >= 2, or "
                              "algo.adv_estimator=reinforce_pp or gae (baselines without groups)")
    if cfg.algo.old_logprobs == "sampler" and (cfg.algo.tis_cap is not None or cfg.algo.mis):
        raise ConfigError("algo.old_logprobs=sampler puts the sampler's log-probs in the ratio, which leaves "
                          "algo.tis_cap and algo.mis nothing to correct; give one of them")
    if cfg.algo.clip_low >= 1:
        raise ConfigError(f"algo.clip_low={cfg.algo.clip_low} leaves PPO's ratio no lower bound "
                          "(1 - clip_low); give a value in [0, 1) (algo.clip_high bounds it above)")


def separate_analysis_batch(cfg: Config) -> bool:
    """Whether the gradient analysis draws its own batch rather than reusing the training batch."""
    a, t = cfg.analysis, cfg.train
    return (a.env_groups is not None and a.env_groups != t.env_groups) or (
        a.group_size is not None and a.group_size != t.group_size)


def _validate_staleness(cfg: Config) -> None:
    """The off-policy lag's companions: overlap needs a lag and keyed sampling; the periodic sync is another lag."""
    r = cfg.rollout
    if r.overlap and r.staleness == 0:
        raise ConfigError("rollout.overlap=true needs rollout.staleness >= 1: a batch generated during the update "
                          "before it cannot come from that update's weights; set rollout.staleness=1")
    if r.overlap and not cfg.train.row_seeded_sampling:
        raise ConfigError("rollout.overlap=true needs train.row_seeded_sampling=true: a rollout in a second thread "
                          "must not draw from the process's RNG, which the update's own passes seed and restore")
    if r.staleness > 0 and r.engine == "vllm" and cfg.analysis.enabled and separate_analysis_batch(cfg):
        raise ConfigError("rollout.staleness with rollout.engine=vllm: the engine holds the sampler's lagged weights, "
                          "so the gradient analysis cannot draw its own batch of the current policy from it; leave "
                          "analysis.env_groups and analysis.group_size unset (it then analyses the training batch)")
    if r.staleness > 0 and r.sync_every > 1:
        raise ConfigError(f"rollout.staleness={r.staleness} with rollout.sync_every={r.sync_every}: both set how old "
                          "the sampler's weights are; give one of them (staleness: a fixed lag)")


def _validate_env(env: EnvConfig) -> None:
    """The env name, its own keys (checked by constructing the env), the reply opener and the reward weights."""
    if env.open_answer and env.enable_think:
        raise ConfigError("env.open_answer=true needs env.enable_think=false (with think the prompt opens <think>)")
    if env.name not in ENVS:
        raise ConfigError(f"env.name={env.name!r} is not a registered env; choose one of: {', '.join(ENVS)}"
                          f"{_suggest(env.name, list(ENVS))}")
    try:
        instance = ENVS[env.name](**env.options())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"bad value in env.{env.name}: {e}") from e
    if env.answer_only and getattr(instance, "full_reply", False):
        raise ConfigError(f"env.answer_only=true has no effect on env {env.name!r}: it grades the whole reply, not "
                          "an <answer> tag; leave env.answer_only unset")
    if getattr(instance, "attempts", 1) > env.max_turns:
        raise ConfigError(f"env.{env.name}.attempts={instance.attempts} needs env.max_turns >= {instance.attempts} "
                          f"(one turn per attempt), got env.max_turns={env.max_turns}")
    names = _check_reward_funcs(instance, env)
    unknown = sorted(set(env.reward_weights) - set(names))
    if unknown:
        raise ConfigError(f"env.reward_weights names unknown reward components {unknown}; env {env.name!r} has "
                          f"{', '.join(names)}")


def _check_reward_funcs(instance, env: EnvConfig) -> tuple[str, ...]:
    """The rollout's reward component names, once `env.reward_funcs` are imported and fit the env (ConfigError)."""
    try:
        funcs = load_reward_funcs(env.reward_funcs)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if funcs and env.max_turns != 1 and not getattr(instance, "full_reply", False):
        raise ConfigError(f"env.reward_funcs grade one reply, but env {env.name!r} has env.max_turns={env.max_turns}; "
                          "use a single-turn env (math, prompts) or set env.max_turns=1")
    own = own_reward_names(instance, env.format_penalty)
    clash = [f.name for f in funcs if f.name in own]
    if clash:
        raise ConfigError(f"env.reward_funcs: {clash[0]!r} is already a reward component of env {env.name!r} "
                          f"({', '.join(own)}); rename the function")
    if not own and not funcs:
        raise ConfigError(f"env {env.name!r} has no reward of its own: name your reward functions in "
                          "env.reward_funcs=[module:function] (`rldyn envs`)")
    return own + tuple(f.name for f in funcs)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def make_config(preset: str | None = "sokoban-tiny", file: str | Path | None = None,
                overrides: list[str] | None = None, base: Config | None = None) -> Config:
    """Build a validated Config: `base` (default: the defaults), a preset, a YAML file, `key=value` overrides."""
    cfg = base or Config()
    if preset:
        cfg = _merge(cfg, preset_dict(preset), f"preset {preset!r}")
    user: list[tuple[dict[str, Any], str]] = []
    if file:
        user.append((read_config_file(file), str(file)))
    if overrides:
        user.append((parse_overrides(overrides), "command-line overrides"))
    for data, source in user:
        cfg = _merge(cfg, data, source)
    for data, source in user:
        _check_env_sections(data, cfg.env.name, source)
    return validate(cfg)


def _check_env_sections(data: dict[str, Any], name: str, source: str) -> None:
    """Keys of an env other than the selected one are an error (they would silently do nothing)."""
    for other, keys in (data.get("env") or {}).items():
        if other in ENVS and other != name and isinstance(keys, dict):
            key = f"env.{other}.{next(iter(keys), '')}"
            raise ConfigError(f"{key} in {source} is a key of env {other!r}, but env.name={name!r}; "
                              f"set env.name={other} or use env.{name}.* keys (`rldyn envs` lists them)")


def read_config_file(file: str | Path) -> Any:
    """The raw contents of a YAML config file (ConfigError naming the file when it cannot be used)."""
    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist" if not path.exists() else
                          f"config file {str(path)!r} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    return _read_yaml(text, f"config file {str(path)!r}") or {}


def apply_overrides(cfg: Config, overrides: list[str], source: str = "command-line overrides") -> Config:
    """A validated copy of `cfg` with `key=value` overrides applied."""
    return validate(_merge(cfg, parse_overrides(overrides), source)) if overrides else cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of a Config; of the env sections only the selected env's is kept."""
    data = dataclasses.asdict(cfg)
    for other in ENVS:
        if other != cfg.env.name:
            data["env"].pop(other, None)
    return data


REMEDY_KEYS = ("train.lr", "train.max_grad_norm", "train.temperature", "train.weight_decay", "critic.lr", "algo.",
               "filter.")  # what a rollback may change (`health.remedy`; an entry ending in "." covers a section)
NOT_REMEDIES = ("algo.adv_estimator",)  # a critic cannot appear or vanish at a rollback


def apply_remedy(cfg: Config) -> tuple[Config, dict[str, tuple[Any, Any]]]:
    """`cfg` with `health.remedy` applied once, and each changed key -> (before, after); ConfigError naming the
    entry for a key a rollback may not change, a factor that is not a number, or a value the key cannot take."""
    changes: dict[str, tuple[Any, Any]] = {}
    for entry in cfg.health.remedy:
        key, op, text = _remedy_parts(entry)
        before = _get(cfg, key)
        if op == "*=":
            value = before * _factor(entry, before, text)
            text = repr(int(value) if isinstance(before, int) and not isinstance(before, bool) else value)
        try:
            cfg = _validate_fields(_merge(cfg, parse_overrides([f"{key}={text}"]), f"health.remedy entry {entry!r}"))
        except ConfigError as e:
            raise ConfigError(f"health.remedy entry {entry!r}: {e}") from None
        changes[key] = (changes.get(key, (before,))[0], _get(cfg, key))
    return cfg, {k: (old, new) for k, (old, new) in changes.items() if old != new}


def _remedy_parts(entry: str) -> tuple[str, str, str]:
    """`train.lr*=0.5` -> (train.lr, *=, 0.5); ConfigError for an entry of another form or key."""
    match = re.fullmatch(r"\s*([\w.]+)\s*(\*=|=)\s*(.+?)\s*", entry)
    if match is None:
        raise ConfigError(f"health.remedy entry {entry!r}: write key=value or key*=factor (e.g. train.lr*=0.5)")
    key = match.group(1)
    if key not in all_keys() or key in NOT_REMEDIES or not any(
            key == k or (k.endswith(".") and key.startswith(k)) for k in REMEDY_KEYS):
        raise ConfigError(f"health.remedy entry {entry!r}: a rollback can change the learning rates, "
                          "train.max_grad_norm, train.temperature, train.weight_decay, algo.* (not adv_estimator) "
                          f"and filter.*, not {key}")
    return key, match.group(2), match.group(3)


def _factor(entry: str, before: Any, text: str) -> float:
    if isinstance(before, bool) or not isinstance(before, (int, float)):
        raise ConfigError(f"health.remedy entry {entry!r}: *= needs a number, and the key holds {before!r}")
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"health.remedy entry {entry!r}: the factor {text!r} is not a number") from None


RESUME_MAY_CHANGE = ("train.steps", "checkpoint.", "log.", "early_stop.", "record.", "filter.empty_stop_steps",
                     "model.device", "model.threads", "model.shard")  # what a resumed run may change: how long it
# goes on, when it stops, where and how it logs, which steps it records, the device and threads; every other key
# keeps the run's config.yaml (a prefix ending in "." covers a section)


def resume_may_change() -> str:
    """`RESUME_MAY_CHANGE` as users read it: "train.steps, checkpoint.*, ... and model.shard"."""
    keys = [k + "*" if k.endswith(".") else k for k in RESUME_MAY_CHANGE]
    return ", ".join(keys[:-1]) + " and " + keys[-1]


def config_diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every key whose values differ."""
    return [(key, _get(a, key), _get(b, key)) for key in all_keys() if _get(a, key) != _get(b, key)]


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (to a temporary file renamed over the old one: a kill keeps one whole;
    never through a link, `tracking.files`)."""
    write_file(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def load_config(path: str | Path) -> Config:
    """Load a config saved by `save_config` (validated; ConfigError naming the file when it is unusable)."""
    return validate(_merge(Config(), read_config_file(path), str(path)))


def help_text() -> str:
    """Every key with its default and docstring, for `rldyn train --help-config`."""
    keys = documented_keys(Config())
    width = max(len(f"{key}={default!s}") for key, default, _ in keys)
    return "\n".join(f"  {f'{key}={default!s}':<{width}}  {doc}" for key, default, doc in keys)


def documented_keys(obj: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, docstring) of every field of a config dataclass instance, sections recursively."""
    docs: dict[str, str] = {}
    for cls in reversed(type(obj).__mro__):
        if dataclasses.is_dataclass(cls):
            docs.update(field_docs(cls))
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += documented_keys(value, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", value, docs.get(f.name, "")))
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, read from its source."""
    import ast
    import inspect
    import textwrap

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # built at run time (the env section type) or defined without a source file
        return {}
    body = ast.parse(textwrap.dedent(source)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:] + [None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = nxt.value.value
    return docs
