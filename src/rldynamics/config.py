"""Configuration: one dataclass per pipeline stage, YAML presets, `key=value` overrides.

Design choices:
- Each knob has exactly one default, here, with a docstring under it. Library code reads fields; it
  never does `cfg.get(key, default)`.
- Presets (`presets/*.yaml` in the package) hold only the fields that differ from these defaults.
  Precedence: defaults < preset < YAML file < `key=value` overrides.
- Merging goes through OmegaConf structured configs, so types are checked; unknown keys and bad values
  fail before any work with the key named and close matches suggested (`ConfigError`).
- Choices are plain strings checked against tuples in `validate`; the resolved config is saved as YAML
  in the run directory and can be loaded back with `load_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rldynamics import ragen_keys
from rldynamics.envs import ENVS


class ConfigError(ValueError):
    """A bad config key or value; the message names it and says how to fix it."""


@dataclass
class ModelConfig:
    path: str = "tiny"
    """HF model id or local directory; `tiny` = the embedded default model built locally."""
    dtype: str = "float32"
    """Parameter dtype: float32 | bfloat16 | float16 | auto."""
    chat_template: str | None = None
    """Prompt format: null = the tokenizer's own chat template | chatml | path to a Jinja template file."""
    device: str = "auto"
    """Device: auto (cuda if available, else cpu) | cpu | cuda | cuda:N."""
    tiny_hidden_size: int = 64
    """Tiny model only: hidden size of the embedded Qwen2-architecture model."""
    tiny_layers: int = 2
    """Tiny model only: transformer layers."""
    warm_start_episodes: int = 8192
    """Tiny model only: solver demonstrations (episodes) for the supervised warm start (0 = none)."""
    warm_start_turns: int = 1
    """Tiny model only: turns per demonstration episode (1 = many cheap single-state examples)."""
    warm_start_noise: float = 0.4
    """Tiny model only: probability that a demonstrated action is replaced by a random one."""
    warm_start_epochs: int = 6
    """Tiny model only: passes over the demonstrations in the warm start."""
    warm_start_lr: float = 1e-3
    """Tiny model only: AdamW learning rate of the warm start."""


@dataclass
class EnvConfig:
    """Keys every env shares; each registered env adds its own section `env.<name>.*` (see `env_config_type`)."""

    name: str = "sokoban"
    """Environment name in `rldynamics.envs.ENVS` (`rldyn envs` lists them with their keys)."""
    max_turns: int = 5
    """Turns per episode (one model response per turn)."""
    max_actions_per_turn: int = 2
    """Actions executed per turn; extra actions in a response are dropped."""
    max_actions_per_traj: int = 10
    """Actions per episode; the episode ends (truncated) when reached."""
    max_new_tokens: int = 24
    """Tokens the model may generate per turn."""
    enable_think: bool = False
    """Require `<think>...</think>` before `<answer>...</answer>` (the prompt opens the `<think>`)."""
    format_penalty: float = -0.1
    """Reward component `format_penalty`, added once per malformed turn (0 = no such component)."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Weight of a reward component in the trained score, e.g. env.reward_weights.box=2 (unset: the env's default)."""

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
    steps: int = 30
    """Training steps (one rollout + update each)."""
    env_groups: int = 16
    """Groups per rollout; the envs of a group share one initial state."""
    group_size: int = 8
    """Trajectories per group."""
    seed_base: int = 10000
    """Step s uses env seeds seed_base + env_groups*(s-1) + g (RAGEN's train seeds)."""
    lr: float = 2e-4
    """Actor AdamW learning rate."""
    weight_decay: float = 0.01
    """Actor AdamW weight decay."""
    ppo_epochs: int = 1
    """Passes over the batch per step."""
    mini_batch_size: int = 32
    """Sequences per optimizer step."""
    micro_batch_size: int = 16
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    max_grad_norm: float = 1.0
    """Global L2 gradient clipping (the pre-clip norm is logged as actor/grad_norm)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    shuffle: bool = False
    """Shuffle sequences before splitting into mini-batches (seeded)."""


@dataclass
class ValConfig:
    every: int = 10
    """Validate every N steps (and after the last step); 0 = never in the loop."""
    before_train: bool = True
    """Validate before the first step (logged at step 0)."""
    env_groups: int = 256
    """Validation puzzles (fixed seeds seed_base .. seed_base+env_groups-1)."""
    group_size: int = 1
    """Samples per validation puzzle."""
    temperature: float = 0.5
    """Sampling temperature of validation rollouts."""
    seed_base: int = 123
    """First validation env seed (RAGEN's)."""


@dataclass
class AlgoConfig:
    adv_estimator: str = "gae"
    """gae | grpo | rloo | reinforce_pp."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO)."""
    policy_loss: str = "ppo"
    """ppo (dual-clip when clip_c is set) | cispo."""
    clip_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """Upper clip range: ratio <= 1 + clip_high (clip-higher)."""
    clip_c: float | None = 3.0
    """Dual-clip constant for negative advantages (> 1), or null to disable."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    kl_coef: float = 0.0
    """KL loss coefficient (a reference model is loaded only when > 0 or when analysis needs it)."""
    kl_type: str = "low_var_kl"
    """k1|kl, k2|mse, k3|low_var_kl, abs; a trailing + = straight-through k2 gradient."""
    entropy_coef: float = 0.001
    """Entropy bonus coefficient."""


@dataclass
class CriticConfig:
    lr: float = 1e-3
    """Critic AdamW learning rate (GAE only)."""
    clip_range: float = 0.5
    """Value clipping range around the old values."""
    max_grad_norm: float = 1.0
    """Critic gradient clipping."""
    ppo_epochs: int | None = None
    """Passes of the critic over the batch per step (null = train.ppo_epochs)."""
    warmup_steps: int = 0
    """The first N steps update only the critic (no actor update, no analysis); RAGEN's trainer.critic_warmup."""


@dataclass
class FilterConfig:
    strategy: str = "top_p"
    """none | top_p | top_k | top_k_abs | min_p (whole groups are kept or dropped)."""
    value: float = 1.0
    """Strategy parameter (top_p: mass; top_k: fraction of groups; top_k_abs: count; min_p: ratio)."""
    keep: str = "largest"
    """largest | smallest scores are kept."""
    metric: str = "reward_std"
    """Group score: reward_std | reward | reward_sum | reward_max."""
    prob_mode: str = "linear"
    """top_p: linear | softmax."""
    include_zero: bool = True
    """Keep groups whose score is zero as candidates."""
    loss_scaling: str = "none"
    """Scale advantages by the kept ratio: none | linear | sqrt."""
    empty_stop_steps: int = 5
    """Stop after this many consecutive steps with an empty filtered batch (<= 0 disables)."""


@dataclass
class AnalysisConfig:
    enabled: bool = False
    """Run the gradient analysis on schedule."""
    every: int = 10
    """Analyse at steps 1, 1+every, 1+2*every, ..."""
    num_buckets: int = 6
    """Reward-variance buckets."""
    bucket_mode: str = "quantile"
    """quantile | fixed_rv."""
    zero_bucket: bool = True
    """Zero-variance groups form their own bucket_0 and tied reward stds share a bucket (false: RAGEN's plain split)."""
    per_group: bool = False
    """Differentiate every group alone too: per-group norms in groups.csv, 95 % bootstrap CIs (.../ci_low|ci_high)."""
    bootstrap_resamples: int = 1000
    """Bootstrap resamples of the per-group intervals (with per_group)."""
    env_groups: int | None = None
    """Separate analysis batch: groups (null = analyse the training batch)."""
    group_size: int | None = None
    """Separate analysis batch: group size (null = training group size)."""
    exit_after: bool = False
    """End the run right after the first analysis (no update, no checkpoint)."""
    only: bool = False
    """Probe mode: never update critic or actor."""
    prefilter: bool = False
    """Also analyse the separate analysis batch before filtering."""
    reward_grad: bool = False
    """Also analyse each named reward component's own gradient (reward_grad/<bucket>/*, reward_grad.json)."""
    terms: list[str] = field(default_factory=lambda: ["task", "entropy", "kl"])
    """Loss terms the probe differentiates: any of task, entropy, kl ([] with reward_grad: components only)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every N steps (and at the end when > 0); 0 = only at the end if save_last."""
    save_last: bool = True
    """Save a checkpoint after the last step."""
    keep_last: int = 0
    """Keep only the newest N checkpoints, deleting older ones after each save (0 = keep all)."""
    resume: str | None = None
    """Resume from a checkpoint directory, or `latest` (newest in this run's checkpoints/)."""


@dataclass
class EarlyStopConfig:
    enabled: bool = True
    """Stop on reward-variance collapse, low validation success or repeated empty batches."""
    rv_baseline_steps: int = 10
    """Steps that form the reward-std baseline."""
    rv_window: int = 10
    """Consecutive steps that must all be below rv_ratio * baseline."""
    rv_ratio: float = 0.1
    """Collapse threshold as a fraction of the baseline."""
    val_success_threshold: float = 0.01
    """Validation success below this counts as a low-success validation."""
    val_patience: int = 5
    """Consecutive low-success validations that stop the run."""


@dataclass
class LogConfig:
    run_dir: str = "runs"
    """Parent directory of run directories."""
    name: str | None = None
    """Run name (default: <env>_<model>_<time>)."""
    samples_per_step: int = 4
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
class Config:
    seed: int = 0
    """Seed of model init, sampling and shuffling."""
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=lambda: env_config_type()())
    train: TrainConfig = field(default_factory=TrainConfig)
    val: ValConfig = field(default_factory=ValConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    log: LogConfig = field(default_factory=LogConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16", "auto"),
    "algo.adv_estimator": ("gae", "grpo", "rloo", "reinforce_pp"),
    "algo.policy_loss": ("ppo", "cispo"),
    "algo.loss_agg_mode": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    "algo.kl_type": tuple(k + s for k in ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs") for s in ("", "+")),
    "filter.strategy": ("none", "top_p", "top_k", "top_k_abs", "min_p"),
    "filter.keep": ("largest", "smallest"),
    "filter.metric": ("reward_std", "reward_variance", "reward", "reward_mean", "reward_sum", "reward_max"),
    "filter.prob_mode": ("linear", "softmax"),
    "filter.loss_scaling": ("none", "linear", "sqrt"),
    "analysis.bucket_mode": ("quantile", "fixed_rv"),
}

POSITIVE_INTS = (
    "env.max_turns", "env.max_actions_per_turn", "env.max_actions_per_traj", "env.max_new_tokens",
    "train.env_groups", "train.group_size", "train.ppo_epochs", "train.mini_batch_size", "train.micro_batch_size",
    "val.env_groups", "val.group_size", "analysis.every", "analysis.num_buckets", "analysis.bootstrap_resamples",
)  # fmt: skip


def preset_names() -> list[str]:
    """Names of the presets shipped with the package."""
    files = resources.files("rldynamics") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def _preset_dict(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(names)}{_suggest(name, names)}")
    text = (resources.files("rldynamics") / "presets" / f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


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


def _check_keys(data: dict[str, Any], source: str, prefix: str = "") -> None:
    """Raise ConfigError for any key in `data` that is not a config key."""
    known = all_keys()
    sections = {k.rsplit(".", i)[0] for k in known for i in range(1, k.count(".") + 1)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted in sections:
            _check_keys(value, source, f"{dotted}.")
        elif dotted not in known:
            raise ConfigError(f"unknown config key {dotted!r} in {source}{_suggest(dotted, known)}")


def split_override(item: str) -> tuple[str, Any]:
    """`"train.lr=1e-5"` -> `("train.lr", "1e-5" parsed as YAML)`; Hydra's `+key=` / `++key=` mean `key=`."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if key.startswith("~"):
        raise ConfigError(f"override {item!r}: Hydra deletions (~key) are not supported; set the key instead")
    key = key[2:] if key.startswith("++") else key[1:] if key.startswith("+") else key
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=1e-5)")
    return key, yaml.safe_load(raw) if raw else ""


def _translated(overrides: list[str]) -> ragen_keys.Translation:
    """The overrides as `(our key, value)` pairs, RAGEN / verl keys translated (`rldynamics.ragen_keys`)."""
    try:
        return ragen_keys.translate([split_override(item) for item in overrides])
    except ragen_keys.UnsupportedKey as e:
        raise ConfigError(str(e)) from e


def ragen_translation(overrides: list[str]) -> list[str]:
    """One line per RAGEN / verl key among `overrides`: what it became (the CLI prints these once)."""
    return _translated(overrides).lines


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn `["train.lr=1e-5", "filter.value=0.9"]` into a nested dict (values parsed as YAML scalars).

    RAGEN / verl keys (`actor_rollout_ref.rollout.rollout_filter_value=0.9`, ...) are translated to ours first.
    """
    nested: dict[str, Any] = {}
    for key, value in _translated(overrides).pairs:
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def _merge(base: Config, data: dict[str, Any], source: str) -> Config:
    _check_keys(data, source)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(base), OmegaConf.create(data))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        reason = str(e).splitlines()[0]
        raise ConfigError(f"bad value for config key {key!r} in {source}: {reason}") from e


def validate(cfg: Config) -> Config:
    """Check choices and ranges; raise ConfigError naming the key and the allowed values."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
    for key in POSITIVE_INTS:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key} must be a positive integer, got {_get(cfg, key)}")
    if cfg.critic.warmup_steps < 0:
        raise ConfigError(f"critic.warmup_steps must be >= 0, got {cfg.critic.warmup_steps}")
    if cfg.critic.ppo_epochs is not None and cfg.critic.ppo_epochs < 1:
        raise ConfigError(f"critic.ppo_epochs must be >= 1 (or null = train.ppo_epochs), got {cfg.critic.ppo_epochs}")
    if cfg.checkpoint.keep_last < 0:
        raise ConfigError(f"checkpoint.keep_last must be >= 0 (0 = keep all), got {cfg.checkpoint.keep_last}")
    if cfg.train.steps < 0:
        raise ConfigError(f"train.steps must be >= 0, got {cfg.train.steps}")
    if cfg.filter.value < 0:
        raise ConfigError(f"filter.value must be >= 0, got {cfg.filter.value}")
    if cfg.algo.clip_c is not None and cfg.algo.clip_c <= 1:
        raise ConfigError(f"algo.clip_c must be > 1 (or null to disable dual clip), got {cfg.algo.clip_c}")
    if cfg.train.temperature <= 0 or cfg.val.temperature <= 0:
        raise ConfigError("train.temperature and val.temperature must be > 0")
    unknown = sorted(set(cfg.analysis.terms) - {"task", "entropy", "kl"})
    if unknown:
        raise ConfigError(f"analysis.terms has unknown terms {unknown}; choose from task, entropy, kl")
    if not cfg.analysis.terms and not cfg.analysis.reward_grad:
        raise ConfigError("analysis.terms=[] leaves nothing to analyse; list terms or set analysis.reward_grad=true")
    _validate_env(cfg.env)
    return cfg


def _validate_env(env: EnvConfig) -> None:
    """The env name, its own keys (checked by constructing the env) and the reward weights."""
    if env.name not in ENVS:
        raise ConfigError(f"env.name={env.name!r} is not a registered env; choose one of: {', '.join(ENVS)}"
                          f"{_suggest(env.name, list(ENVS))}")
    try:
        instance = ENVS[env.name](**env.options())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"bad value in env.{env.name}: {e}") from e
    names = reward_names(instance, env)
    unknown = sorted(set(env.reward_weights) - set(names))
    if unknown:
        raise ConfigError(f"env.reward_weights names unknown reward components {unknown}; env {env.name!r} has "
                          f"{', '.join(names)}")


def reward_names(env, cfg: EnvConfig) -> tuple[str, ...]:
    """The reward components of a rollout: the env's own, then `format_penalty` when it is non-zero (never for
    envs that grade the whole reply, `full_reply`: they judge format themselves)."""
    penalty = cfg.format_penalty != 0 and not getattr(env, "full_reply", False)
    return tuple(env.reward_names) + (("format_penalty",) if penalty else ())


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def make_config(preset: str | None = "sokoban-tiny", file: str | Path | None = None,
                overrides: list[str] | None = None) -> Config:
    """Build a validated Config from defaults, a preset, an optional YAML file and `key=value` overrides."""
    cfg = Config()
    if preset:
        cfg = _merge(cfg, _preset_dict(preset), f"preset {preset!r}")
    user: list[tuple[dict[str, Any], str]] = []
    if file:
        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        user.append((yaml.safe_load(path.read_text()) or {}, str(path)))
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


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def load_config(path: str | Path) -> Config:
    """Load a config saved by `save_config` (validated)."""
    return validate(_merge(Config(), yaml.safe_load(Path(path).read_text()) or {}, str(path)))


def help_text() -> str:
    """Every key with its default and docstring, for `rldyn train --help-config`."""
    return "\n".join(f"  {key}={default!s:<12} {doc}" for key, default, doc in documented_keys(Config()))


def envs_help() -> str:
    """`rldyn envs`: each env's keys with defaults and meanings, reward components and actions."""
    blocks = []
    shared = EnvConfig()
    for name, cls in ENVS.items():
        env = cls(**dataclasses.asdict(cls.Config()))
        weights = ", ".join(f"{r} (weight {env.reward_weights.get(r, 1.0):g})" for r in env.reward_names)
        actions = ", ".join(env.actions) if env.actions else "free-form answer text"
        actions = "the whole reply" if getattr(env, "full_reply", False) else actions
        penalty = ("; graded on the whole reply (no format_penalty)" if getattr(env, "full_reply", False) else
                   f"; plus format_penalty (env.format_penalty={shared.format_penalty:g}) for malformed turns")
        lines = [f"{name}  ({cls.__module__}.{cls.__name__})", f"  reward components: {weights}{penalty}",
                 f"  actions: {actions}"]
        keys = documented_keys(cls.Config(), f"env.{name}.")
        lines += [f"  {key}={default!s:<12} {doc}" for key, default, doc in keys]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\nshared keys: env.name, env.max_turns, env.max_actions_per_turn, " \
        "env.max_actions_per_traj, env.max_new_tokens, env.enable_think, env.format_penalty, env.reward_weights " \
        "(`rldyn train --help-config`)."


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
