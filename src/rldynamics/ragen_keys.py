"""RAGEN / verl override names, mapped onto rldynamics config keys through one table (`RAGEN_KEYS`).

A RAGEN or verl user can paste overrides as they are:

    rldyn train actor_rollout_ref.rollout.rollout_filter_value=0.9 es_manager.train.env_groups=8

`translate` rewrites each known key to ours, translating values where the conventions differ (`-1` = never,
`reward_variance` = our `reward_std`, `use_kl_loss=False` = `algo.kl_coef=0`, ...); the CLI prints the
translation once. Keys that never change results here (GPU memory, Ray, device lists, per-GPU micro-batches)
are accepted and reported as ignored, with the reason; RAGEN keys with no equivalent are rejected by name,
with the reason. Env-tag keys (`custom_envs.CoordSokoban.env_config.dim_room`) map to the env's own section
(`env.sokoban.dim_room`). Hydra's `+key=` / `++key=` prefixes are stripped by the override parser
(`config.split_override`). `rldyn train --help-config --ragen` prints the table.

This module imports nothing of rldynamics: `config.parse_overrides` calls `translate` on every override list.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SOKOBAN_TAG = "<Sokoban tag>"  # CoordSokoban, SimpleSokoban, LargerSokoban, ... (any tag naming Sokoban)
USE_KL_LOSS = "actor_rollout_ref.actor.use_kl_loss"
KL_LOSS_COEF = "actor_rollout_ref.actor.kl_loss_coef"
RAGEN_SECTIONS = ("actor_rollout_ref", "es_manager", "trainer", "algorithm", "agent_proxy", "custom_envs",
                  "ray_kwargs", "system", "data", "model_path",
                  "collapse_detection", "lora")  # key prefixes that are never ours


class UnsupportedKey(ValueError):
    """A RAGEN / verl key or value rldynamics cannot honour; the message names it and says why."""


@dataclass(frozen=True)
class Rule:
    """How one RAGEN / verl key translates.

    `target` names our key(s) (shown in the help). Without `convert` the value is carried over as is;
    `convert` turns RAGEN's value into `{our key: value}` and raises ValueError, with the reason, for values
    we cannot honour. No target: the key is ignored (`note` says why), or refused when `rejected`.
    """

    target: str = ""
    convert: Callable[[Any], dict[str, Any]] | None = None
    note: str = ""
    rejected: bool = False

    def apply(self, value: Any) -> dict[str, Any]:
        """Our `{key: value}` assignments for RAGEN's `value` (empty when ignored)."""
        if self.convert is not None:
            return self.convert(value)
        return {self.target: value} if self.target else {}


def ignored(reason: str) -> Rule:
    return Rule(note=reason)


def rejected(reason: str) -> Rule:
    return Rule(note=reason, rejected=True)


# ------------------------------------------------------------------------------------------- value conversions


def _never_below_one(key: str, off: dict[str, Any] | None = None) -> Callable[[Any], dict[str, Any]]:
    """RAGEN's `N <= 0` = never: our `key=N`, or `off` (default `key=0`) for N <= 0."""
    def convert(value: Any) -> dict[str, Any]:
        n = int(value)
        return {key: n} if n > 0 else (off if off is not None else {key: 0})
    return convert


def _save_freq(value: Any) -> dict[str, Any]:
    n = int(value)
    return {"checkpoint.every": n, "checkpoint.save_last": True} if n > 0 else {
        "checkpoint.every": 0, "checkpoint.save_last": False}


def _as_list(value: Any) -> list:
    """A list value, also when the shell handed over its text (`"['console','wandb']"`, `"(6, 6)"`)."""
    if isinstance(value, str) and value.strip()[:1] in "[(":
        value = ast.literal_eval(value.strip())
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _logger(value: Any) -> dict[str, Any]:
    names = {str(v).strip().lower() for v in _as_list(value)}
    unknown = sorted(names - {"console", "wandb", "tensorboard"})
    if unknown:
        raise ValueError(f"loggers {unknown} are not available; rldynamics mirrors to wandb and tensorboard")
    return {"log.wandb": "wandb" in names, "log.tensorboard": "tensorboard" in names}


def _filter_metric(value: Any) -> dict[str, Any]:
    metric = str(value).lower()
    ours = {"reward_variance": "reward_std", "reward_std": "reward_std", "reward": "reward",
            "reward_sum": "reward_sum"}.get(metric)
    if ours is None:
        raise ValueError("entropy and length filters are not implemented; groups are scored by their rewards "
                         "(reward_variance, reward, reward_sum)")
    return {"filter.metric": ours}


def _kl_type(value: Any) -> dict[str, Any]:
    kind = str(value)
    if kind.rstrip("+") == "full":
        raise ValueError("the full KL is not implemented (verl does not implement it either)")
    return {"algo.kl_type": kind.replace("-", "_")}  # low-var-kl: verl itself fails on it once the KL loss is on


def _use_kl_loss(value: Any) -> dict[str, Any]:
    return {} if value else {"algo.kl_coef": 0.0}


def _adv_estimator(value: Any) -> dict[str, Any]:
    ours = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp"}.get(str(value))
    if ours is None:
        raise ValueError("available estimators: gae, grpo, rloo, reinforce_plus_plus")
    return {"algo.adv_estimator": ours}


def _one_tag_count(value: Any) -> dict[str, Any]:
    if len(_as_list(value)) != 1:
        raise ValueError("a run has one env (env.name); mixtures of env tags are not supported")
    return {}


SOKOBAN_TAGS = {
    "CoordSokoban": {"env.name": "sokoban", "env.sokoban.observation_format": "grid_coord"},
    "SimpleSokoban": {"env.name": "sokoban", "env.sokoban.observation_format": "grid"},
    "LargerSokoban": {"env.name": "sokoban", "env.sokoban.dim_room": [8, 8], "env.sokoban.num_boxes": 2,
                      "env.sokoban.search_depth": 10, "env.sokoban.observation_format": "grid"},
}


def _tags(value: Any) -> dict[str, Any]:
    tags = _as_list(value)
    if len(tags) != 1:
        raise ValueError("a run has one env (env.name); mixtures of env tags are not supported")
    if str(tags[0]) not in SOKOBAN_TAGS:
        raise ValueError(f"env tag {tags[0]!r} is not available; tags: {', '.join(SOKOBAN_TAGS)}")
    return dict(SOKOBAN_TAGS[str(tags[0])])


def _resume_mode(value: Any) -> dict[str, Any]:
    mode = str(value)
    if mode not in ("auto", "disable", "resume_path"):
        raise ValueError("resume modes: auto, disable, resume_path")
    return {"auto": {"checkpoint.resume": "latest"}, "disable": {"checkpoint.resume": None}}.get(mode, {})


def _target_modules(value: Any) -> dict[str, Any]:
    """verl's `target_modules`: `all-linear` or a list of module names (also as the shell's text)."""
    return {"model.lora.target_modules": [str(v).strip() for v in _as_list(value)]}


def _dim_room(value: Any) -> dict[str, Any]:
    return {"env.sokoban.dim_room": [int(v) for v in _as_list(value)]}


def _only(allowed: Any, reason: str) -> Callable[[Any], dict[str, Any]]:
    """A key we accept only at one value (where it means our behaviour), else refused with `reason`."""
    def convert(value: Any) -> dict[str, Any]:
        if value != allowed:
            raise ValueError(reason)
        return {}
    return convert


def _collapse(key: str) -> Callable[[Any], dict[str, Any]]:
    """A `collapse_detection.<key>` value carried over to `collapse.<key>`, turning the diagnostics on."""
    def convert(value: Any) -> dict[str, Any]:
        return {f"collapse.{key}": value, "collapse.enabled": True}
    return convert


def _compute_freq(value: Any) -> dict[str, Any]:
    n = int(value)
    return {"collapse.compute_freq": n, "collapse.enabled": True} if n > 0 else {"collapse.enabled": False}


def _num_samples(value: Any) -> dict[str, Any]:
    text = str(value).strip().lower()
    return {"collapse.num_samples": 0 if text == "all" else value, "collapse.enabled": True}


# ------------------------------------------------------------------------------------------------------ table

_SAME_RESULTS = "results do not depend on micro-batch sizes here (exact aggregation); train.micro_batch_size is used"
_NO_KL_IN_REWARD = "reward-side KL is not implemented; use the KL loss (algo.kl_coef)"

RAGEN_KEYS: dict[str, Rule] = {
    # trainer
    "trainer.total_training_steps": Rule("train.steps"),
    "trainer.test_freq": Rule("val.every", _never_below_one("val.every"), "-1 (never) -> 0"),
    "trainer.val_before_train": Rule("val.before_train"),
    "trainer.save_freq": Rule("checkpoint.every, checkpoint.save_last", _save_freq,
                              "-1 (never) -> every=0, save_last=false"),
    "trainer.resume_mode": Rule("checkpoint.resume", _resume_mode, "auto -> latest; disable -> null; "
                                "resume_path: the path comes from trainer.resume_from_path"),
    "trainer.resume_from_path": Rule("checkpoint.resume", note="a checkpoint written by rldyn train"),
    "trainer.experiment_name": Rule("log.name"),
    "trainer.project_name": Rule("log.wandb_project"),
    "trainer.default_local_dir": Rule("log.run_dir", note="the run directory is <log.run_dir>/<log.name>"),
    "trainer.logger": Rule("log.wandb, log.tensorboard", _logger, "console is always on"),
    "trainer.gradient_analysis_mode": Rule("analysis.enabled"),
    "trainer.gradient_analysis_every": Rule("analysis.every", _never_below_one(
        "analysis.every", {"analysis.enabled": False}), "<= 0 -> analysis.enabled=false"),
    "trainer.gradient_analysis_env_groups": Rule("analysis.env_groups"),
    "trainer.gradient_analysis_group_size": Rule("analysis.group_size"),
    "trainer.gradient_analysis_log_prefilter": Rule("analysis.prefilter"),
    "trainer.gradient_analysis_only": Rule("", _only(False, "the analysis of a checkpoint without training is its own "
                                                            "command here, `rldyn probe <checkpoint>`; drop the key"),
                                           "True -> `rldyn probe`"),
    "trainer.exit_after_gradient_analysis": Rule("analysis.exit_after"),
    "trainer.log_group_rv_table": ignored("analysis/step_<N>/groups.csv always holds every group's reward std"),
    "trainer.n_gpus_per_node": ignored("batches are never trimmed or padded to the GPU count; several GPUs: "
                                       "torchrun"),
    "trainer.nnodes": ignored("several nodes: torchrun"),
    "trainer.critic_warmup": Rule("", _only(0, "critic warm-up steps are not implemented (only 0)")),
    # es_manager (env groups)
    "es_manager.train.env_groups": Rule("train.env_groups"),
    "es_manager.train.group_size": Rule("train.group_size"),
    "es_manager.train.env_configs.n_groups": Rule("", _one_tag_count, "one env tag for all groups"),
    "es_manager.train.env_configs.tags": Rule("env.name (+ tag settings)", _tags,
                                              "CoordSokoban, SimpleSokoban, LargerSokoban"),
    "es_manager.val.env_groups": Rule("val.env_groups"),
    "es_manager.val.group_size": Rule("val.group_size"),
    "es_manager.val.env_configs.n_groups": Rule("", _one_tag_count, "one env tag for all groups"),
    "es_manager.val.env_configs.tags": Rule("env.name (+ tag settings)", _tags,
                                            "one env for training and validation: the tag sets both"),
    "es_manager.format_penalty": Rule("env.format_penalty"),
    # env tags
    f"custom_envs.{SOKOBAN_TAG}.env_config.dim_room": Rule("env.sokoban.dim_room", _dim_room),
    f"custom_envs.{SOKOBAN_TAG}.env_config.num_boxes": Rule("env.sokoban.num_boxes"),
    f"custom_envs.{SOKOBAN_TAG}.env_config.max_steps": Rule("env.sokoban.max_steps"),
    f"custom_envs.{SOKOBAN_TAG}.env_config.search_depth": Rule("env.sokoban.search_depth"),
    f"custom_envs.{SOKOBAN_TAG}.env_config.observation_format": Rule("env.sokoban.observation_format"),
    f"custom_envs.{SOKOBAN_TAG}.max_actions_per_traj": Rule("env.max_actions_per_traj"),
    f"custom_envs.{SOKOBAN_TAG}.max_tokens": ignored("only a length hint in RAGEN's prompt; the generation budget "
                                                     "is env.max_new_tokens"),
    "agent_proxy.max_turn": Rule("env.max_turns"),
    "agent_proxy.max_actions_per_turn": Rule("env.max_actions_per_turn"),
    "agent_proxy.enable_think": Rule("env.enable_think"),
    # model
    "model_path": Rule("model.path"),
    "actor_rollout_ref.model.path": Rule("model.path"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Rule("model.gradient_checkpointing"),
    "actor_rollout_ref.rollout.dtype": Rule("model.dtype", note="the compute dtype; trained weights stay float32"),
    # LoRA (RAGEN's `lora.*` feeds verl's `actor_rollout_ref.model.*`)
    "lora.rank": Rule("model.lora.rank", note="0 = full fine-tuning"),
    "lora.alpha": Rule("model.lora.alpha"),
    "lora.target_modules": Rule("model.lora.target_modules", _target_modules, "all-linear or a list of names"),
    "actor_rollout_ref.model.lora_rank": Rule("model.lora.rank", note="0 = full fine-tuning"),
    "actor_rollout_ref.model.lora_alpha": Rule("model.lora.alpha"),
    "actor_rollout_ref.model.target_modules": Rule("model.lora.target_modules", _target_modules,
                                                   "all-linear or a list of names"),
    # actor
    "actor_rollout_ref.actor.entropy_coeff": Rule("algo.entropy_coef"),
    USE_KL_LOSS: Rule("algo.kl_coef", _use_kl_loss, "False -> algo.kl_coef=0 whatever kl_loss_coef says; True: "
                      "the KL loss is on when algo.kl_coef (kl_loss_coef) > 0"),
    KL_LOSS_COEF: Rule("algo.kl_coef", note="the KL loss is on whenever algo.kl_coef > 0"),
    "actor_rollout_ref.actor.kl_loss_type": Rule("algo.kl_type", _kl_type, "same names; low-var-kl -> low_var_kl"),
    "actor_rollout_ref.actor.loss_agg_mode": Rule("algo.loss_agg_mode"),
    "actor_rollout_ref.actor.filter_loss_scaling": Rule("filter.loss_scaling"),
    "actor_rollout_ref.actor.clip_ratio_low": Rule("algo.clip_low"),
    "actor_rollout_ref.actor.clip_ratio_high": Rule("algo.clip_high"),
    "actor_rollout_ref.actor.clip_ratio_c": Rule("algo.clip_c"),
    "actor_rollout_ref.actor.ppo_epochs": Rule("train.ppo_epochs"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": Rule("train.mini_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": Rule("train.micro_batch_size", note=_SAME_RESULTS),
    "actor_rollout_ref.actor.ppo_micro_batch_size": Rule("train.micro_batch_size", note=_SAME_RESULTS),
    "actor_rollout_ref.actor.grad_clip": Rule("train.max_grad_norm"),
    "actor_rollout_ref.actor.shuffle": Rule("train.shuffle"),
    "actor_rollout_ref.actor.optim.lr": Rule("train.lr"),
    "actor_rollout_ref.actor.optim.weight_decay": Rule("train.weight_decay"),
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": ignored("memory only (RAGEN's actor ignores it "
                                                                         "too)"),
    "actor_rollout_ref.actor.entropy_checkpointing": ignored("memory only (RAGEN's actor ignores it too)"),
    "actor_rollout_ref.actor.use_dynamic_bsz": ignored(_SAME_RESULTS),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ignored(_SAME_RESULTS),
    # rollout (generation, filter, buckets)
    "actor_rollout_ref.rollout.rollout_filter_strategy": Rule("filter.strategy"),
    "actor_rollout_ref.rollout.rollout_filter_value": Rule("filter.value", note="1.0 + include_zero=True is "
                                                           "RAGEN's nofilter: every group kept"),
    "actor_rollout_ref.rollout.rollout_filter_ratio": Rule("filter.value", note="RAGEN's older name"),
    "actor_rollout_ref.rollout.rollout_filter_type": Rule("filter.keep"),
    "actor_rollout_ref.rollout.rollout_filter_include_zero": Rule("filter.include_zero"),
    "actor_rollout_ref.rollout.rollout_filter_top_p_prob_mode": Rule("filter.prob_mode"),
    "actor_rollout_ref.rollout.rollout_filter_metric": Rule("filter.metric", _filter_metric,
                                                            "reward_variance -> reward_std (both are the std)"),
    "actor_rollout_ref.rollout.rollout_filter_empty_stop_steps": Rule("filter.empty_stop_steps"),
    "actor_rollout_ref.rollout.rollout_filter_selection_eps": Rule("", _only(
        0.01, "the linear top-p slack is fixed at RAGEN's default 0.01")),
    "actor_rollout_ref.rollout.gradient_analysis_num_buckets": Rule("analysis.num_buckets"),
    "actor_rollout_ref.rollout.gradient_analysis_bucket_mode": Rule("analysis.bucket_mode"),
    "actor_rollout_ref.rollout.temperature": Rule("train.temperature"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": Rule("val.temperature"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": Rule("", _only(True, "validation always samples (use a low "
                                                                      "val.temperature)")),
    "actor_rollout_ref.rollout.response_length": Rule("env.max_new_tokens", note="tokens per turn"),
    "actor_rollout_ref.rollout.n": Rule("", _only(1, "samples per prompt are es_manager.train.group_size")),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ignored("vLLM memory share; no effect on results"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ignored("vLLM sharding; no effect on results"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ignored(_SAME_RESULTS),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ignored(_SAME_RESULTS),
    # algorithm
    "algorithm.adv_estimator": Rule("algo.adv_estimator", _adv_estimator, "reinforce_plus_plus -> reinforce_pp"),
    "algorithm.norm_adv_by_std_in_grpo": Rule("algo.norm_adv_by_std"),
    "algorithm.gamma": Rule("algo.gamma"),
    "algorithm.lam": Rule("algo.lam"),
    "algorithm.use_kl_in_reward": Rule("", _only(False, _NO_KL_IN_REWARD)),
    "algorithm.soft_advantage_reweight": Rule("", _only(False, "soft advantage reweighting is not implemented")),
    "algorithm.zero_task_advantage": Rule("", _only(False, "zeroing the task advantage is not implemented")),
    # critic
    "critic.optim.lr": Rule("critic.lr"),
    "critic.cliprange_value": Rule("critic.clip_range"),
    "critic.grad_clip": Rule("critic.max_grad_norm"),
    "critic.ppo_mini_batch_size": Rule("train.mini_batch_size", note="actor and critic share mini-batches"),
    "critic.ppo_micro_batch_size_per_gpu": ignored(_SAME_RESULTS),
    # seeds and machinery
    "seed.train": Rule("train.seed_base"),
    "seed.val": Rule("val.seed_base"),
    "system.CUDA_VISIBLE_DEVICES": ignored("set CUDA_VISIBLE_DEVICES in the environment; model.device picks the "
                                           "device"),
    "ray_kwargs.ray_init.num_cpus": ignored("no Ray here"),
    # whole sections (`<section>.*` matches every key under it)
    # collapse diagnostics (any of these turns them on: RAGEN computes them whenever think mode is on)
    "collapse_detection.compute_freq": Rule("collapse.compute_freq, collapse.enabled", _compute_freq,
                                              "sets collapse.enabled=true; <= 0 -> collapse.enabled=false"),
    "collapse_detection.micro_batch_size": Rule("collapse.micro_batch_size, collapse.enabled",
                                                _collapse("micro_batch_size")),
    "collapse_detection.first_turn_enabled": Rule("collapse.first_turn_enabled, collapse.enabled",
                                                  _collapse("first_turn_enabled")),
    "collapse_detection.multi_turn_enabled": Rule("collapse.multi_turn_enabled, collapse.enabled",
                                                  _collapse("multi_turn_enabled")),
    "collapse_detection.num_samples": Rule("collapse.num_samples, collapse.enabled", _num_samples, "all -> 0"),
    "collapse_detection.std_eps": Rule("collapse.std_eps, collapse.enabled", _collapse("std_eps")),
    "collapse_detection.ema_decay": Rule("collapse.ema_decay, collapse.enabled", _collapse("ema_decay")),
    "reward_model.*": rejected("rewards come from the env (env.reward_weights weighs its components)"),
    "actor_rollout_ref.actor.fsdp_config.*": ignored("sharding and offload; no effect on results (FSDP2 via "
                                                     "torchrun)"),
    "actor_rollout_ref.ref.fsdp_config.*": ignored("sharding and offload; no effect on results"),
    "critic.model.fsdp_config.*": ignored("sharding and offload; no effect on results"),
}


# ---------------------------------------------------------------------------------------------- translation


@dataclass
class Translation:
    """The overrides with RAGEN keys rewritten: `pairs` (our keys, in order) and one `lines` entry per RAGEN key."""

    pairs: list[tuple[str, Any]]
    lines: list[str]


def lookup(key: str) -> tuple[str, Rule] | None:
    """(table key, rule) of a RAGEN / verl key; None for keys that are not RAGEN's (ours pass through).

    Raises UnsupportedKey for a key under a RAGEN-only section that the table does not know.
    """
    if key in RAGEN_KEYS:
        return key, RAGEN_KEYS[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        section = ".".join(parts[:n]) + ".*"
        if section in RAGEN_KEYS:
            return section, RAGEN_KEYS[section]
    if parts[0] == "custom_envs" and len(parts) > 2:
        if "sokoban" not in parts[1].lower():
            raise UnsupportedKey(f"RAGEN key {key!r}: env tag {parts[1]!r} is not available (Sokoban tags only)")
        generic = ".".join(["custom_envs", SOKOBAN_TAG, *parts[2:]])
        if generic in RAGEN_KEYS:
            return generic, RAGEN_KEYS[generic]
    if parts[0] in RAGEN_SECTIONS:
        close = difflib.get_close_matches(key, list(RAGEN_KEYS), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UnsupportedKey(f"RAGEN/verl key {key!r} has no rldynamics equivalent{hint}; "
                             "`rldyn train --help-config --ragen` lists the supported ones")
    return None


def translate(pairs: list[tuple[str, Any]]) -> Translation:
    """Rewrite the RAGEN / verl keys of `(key, value)` overrides into ours; other keys pass through unchanged.

    `use_kl_loss=False` sets algo.kl_coef=0 and makes any kl_loss_coef a no-op, in whatever order they come.
    Two RAGEN keys that set one of our keys to different values are an error naming both.
    """
    kl_off = any(k == USE_KL_LOSS and not v for k, v in pairs)
    out: list[tuple[str, Any]] = []
    lines: list[str] = []
    origin: dict[str, tuple[str, Any]] = {}
    for key, value in pairs:
        found = lookup(key)
        if found is None:
            out.append((key, value))
            continue
        table_key, rule = found
        if rule.rejected:
            raise UnsupportedKey(f"RAGEN/verl key {key!r} is not supported: {rule.note}")
        if table_key == KL_LOSS_COEF and kl_off:
            lines.append(f"{key}={_show(value)} -> no effect ({USE_KL_LOSS}=False)")
            continue
        try:
            assigned = rule.apply(value)
        except (ValueError, TypeError, SyntaxError) as e:
            raise UnsupportedKey(f"{key}={_show(value)} is not supported: {e}") from e
        for ours, v in assigned.items():
            if ours in origin and origin[ours][1] != v:
                raise UnsupportedKey(f"{origin[ours][0]} and {key} set {ours} to different values "
                                     f"({_show(origin[ours][1])} and {_show(v)}); rldynamics has one {ours}")
            origin[ours] = (key, v)
        out.extend(assigned.items())
        became = " ".join(f"{k}={_show(v)}" for k, v in assigned.items()) or (
            f"ignored ({rule.note})" if rule.convert is None else f"nothing to set ({rule.note or 'our default'})")
        if table_key == KL_LOSS_COEF and not any(k == USE_KL_LOSS for k, _ in pairs):
            became += f" (RAGEN applies it only with {USE_KL_LOSS}=True; here a coefficient > 0 is the switch)"
        lines.append(f"{key}={_show(value)} -> {became}")
    return Translation(out, lines)


def _show(value: Any) -> str:
    """A value as typed on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)


def help_table() -> str:
    """The table for `rldyn train --help-config --ragen`: RAGEN / verl key and what it becomes."""
    rows = []
    for key, rule in RAGEN_KEYS.items():
        if rule.rejected:
            became = f"rejected: {rule.note}"
        elif rule.target:
            became = rule.target + (f"   ({rule.note})" if rule.note else "")
        elif rule.convert is None:
            became = f"ignored: {rule.note}"
        else:
            became = _neutral_only_text(rule)
        rows.append(f"  {key:<62} {became}")
    return "\n".join(rows)


def _neutral_only_text(rule: Rule) -> str:
    """Help text of a rule that sets nothing: the reason any other value is refused."""
    try:
        rule.apply(object())  # not the accepted value: the rule raises its reason
    except (ValueError, TypeError) as e:
        return f"accepted at its neutral value only ({e})"
    return rule.note
