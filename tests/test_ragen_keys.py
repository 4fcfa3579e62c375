"""RAGEN / verl override names: every key of RAGEN's gradient-analysis and sweep docs translates, others are refused."""

from __future__ import annotations

import pytest

from rldynamics.cli import main
from rldynamics.config import ConfigError, make_config, parse_overrides, ragen_translation
from rldynamics.ragen_keys import RAGEN_KEYS, SOKOBAN_TAG

# Every Hydra key that appears in RAGEN's guide_gradient_analysis.md, experiment_sokoban_gradient_analysis.md and
# experiment_intervention_sweep.md (grep of `word.word...` names, prose and code blocks), with a value those
# documents use, and the rldynamics assignments it must become ({} = accepted, nothing to set).
SEED_KEYS: list[tuple[str, dict]] = [
    ("trainer.gradient_analysis_mode=True", {"analysis.enabled": True}),
    ("trainer.gradient_analysis_every=50", {"analysis.every": 50}),
    ("trainer.exit_after_gradient_analysis=True", {"analysis.exit_after": True}),
    ("trainer.gradient_analysis_env_groups=128", {"analysis.env_groups": 128}),
    ("trainer.gradient_analysis_group_size=16", {"analysis.group_size": 16}),
    ("trainer.gradient_analysis_log_prefilter=True", {"analysis.prefilter": True}),
    ("trainer.gradient_analysis_only=False", {}),
    ("actor_rollout_ref.rollout.gradient_analysis_num_buckets=6", {"analysis.num_buckets": 6}),
    ("actor_rollout_ref.rollout.gradient_analysis_bucket_mode=fixed_rv", {"analysis.bucket_mode": "fixed_rv"}),
    ("es_manager.train.env_groups=8", {"train.env_groups": 8}),
    ("es_manager.train.group_size=16", {"train.group_size": 16}),
    ("es_manager.train.env_configs.n_groups=[32]", {}),
    ("es_manager.val.env_groups=512", {"val.env_groups": 512}),
    ("es_manager.val.group_size=1", {"val.group_size": 1}),
    ("trainer.n_gpus_per_node=8", {}),
    ("actor_rollout_ref.rollout.rollout_filter_value=0.9", {"filter.value": 0.9}),
    ("actor_rollout_ref.rollout.rollout_filter_strategy=top_p", {"filter.strategy": "top_p"}),
    ("actor_rollout_ref.rollout.rollout_filter_metric=reward_variance", {"filter.metric": "reward_std"}),
    ("actor_rollout_ref.rollout.rollout_filter_top_p_prob_mode=softmax", {"filter.prob_mode": "softmax"}),
    ("actor_rollout_ref.rollout.rollout_filter_include_zero=False", {"filter.include_zero": False}),
    ("actor_rollout_ref.rollout.rollout_filter_type=largest", {"filter.keep": "largest"}),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.3", {}),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", {}),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", {}),
    ("actor_rollout_ref.actor.use_kl_loss=True", {}),
    ("actor_rollout_ref.actor.kl_loss_type=low_var_kl", {"algo.kl_type": "low_var_kl"}),
    ("actor_rollout_ref.actor.kl_loss_type=low-var-kl", {"algo.kl_type": "low_var_kl"}),
    ("actor_rollout_ref.actor.kl_loss_coef=0.001", {"algo.kl_coef": 0.001}),
    ("actor_rollout_ref.actor.entropy_coeff=0.001", {"algo.entropy_coef": 0.001}),
    ("actor_rollout_ref.actor.entropy_from_logits_with_chunking=True", {}),
    ("actor_rollout_ref.actor.filter_loss_scaling=none", {"filter.loss_scaling": "none"}),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", {"algo.loss_agg_mode": "seq-mean-token-mean"}),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=32", {"train.mini_batch_size": 32}),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", {"train.micro_batch_size": 4}),
    ("critic.ppo_mini_batch_size=32", {"train.mini_batch_size": 32}),
    ("critic.ppo_micro_batch_size_per_gpu=4", {}),
    ("algorithm.adv_estimator=gae", {"algo.adv_estimator": "gae"}),
    ("algorithm.norm_adv_by_std_in_grpo=True", {"algo.norm_adv_by_std": True}),
    ("model_path=Qwen/Qwen2.5-3B", {"model.path": "Qwen/Qwen2.5-3B"}),
    ("trainer.project_name=ragen_gradient_analysis", {"log.wandb_project": "ragen_gradient_analysis"}),
    ("trainer.experiment_name=sokoban-PPO-filter-topp09", {"log.name": "sokoban-PPO-filter-topp09"}),
    ("trainer.default_local_dir=model_saving/gradient_analysis", {"log.run_dir": "model_saving/gradient_analysis"}),
    ("trainer.resume_mode=resume_path", {}),
    ("trainer.resume_from_path=/ckpt/global_step_100", {"checkpoint.resume": "/ckpt/global_step_100"}),
    ("trainer.total_training_steps=101", {"train.steps": 101}),
    ("trainer.save_freq=-1", {"checkpoint.every": 0, "checkpoint.save_last": False}),
    ("trainer.save_freq=100", {"checkpoint.every": 100, "checkpoint.save_last": True}),
    ("trainer.val_before_train=False", {"val.before_train": False}),
    ("trainer.test_freq=-1", {"val.every": 0}),
    ("trainer.test_freq=10", {"val.every": 10}),
    ("trainer.logger=['console','wandb']", {"log.wandb": True, "log.tensorboard": False}),
    ("ray_kwargs.ray_init.num_cpus=16", {}),
    ("system.CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7'", {}),
]

# RAGEN's "resume from a checkpoint and probe it once" command (guide_gradient_analysis.md), as pasted.
PROBE_COMMAND = """model_path=Qwen/Qwen2.5-3B trainer.project_name=ragen_gradient_analysis
trainer.experiment_name=sokoban-PPO-filter-topp09-grad-from-ckpt100 trainer.default_local_dir=model_saving/probe
trainer.resume_mode=resume_path trainer.resume_from_path=/ABS/PATH/TO/your_run/global_step_100
trainer.total_training_steps=101 trainer.save_freq=-1 trainer.val_before_train=False trainer.test_freq=-1
trainer.n_gpus_per_node=8 ray_kwargs.ray_init.num_cpus=16 system.CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7'
es_manager.train.env_groups=32 es_manager.train.group_size=16 es_manager.train.env_configs.n_groups=[32]
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_type=low-var-kl
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.entropy_coeff=0.001
actor_rollout_ref.actor.entropy_from_logits_with_chunking=True actor_rollout_ref.actor.filter_loss_scaling=none
actor_rollout_ref.actor.loss_agg_mode=token-mean actor_rollout_ref.rollout.gpu_memory_utilization=0.3
actor_rollout_ref.rollout.rollout_filter_value=0.9 actor_rollout_ref.rollout.rollout_filter_strategy=top_p
actor_rollout_ref.rollout.rollout_filter_top_p_prob_mode=softmax
actor_rollout_ref.rollout.rollout_filter_type=largest actor_rollout_ref.rollout.rollout_filter_metric=reward_variance
actor_rollout_ref.rollout.rollout_filter_include_zero=True
algorithm.adv_estimator=gae trainer.gradient_analysis_mode=True trainer.gradient_analysis_every=1
trainer.exit_after_gradient_analysis=True actor_rollout_ref.rollout.gradient_analysis_num_buckets=6
actor_rollout_ref.rollout.gradient_analysis_bucket_mode=quantile""".split()


def flat(nested: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in nested.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize(("override", "expected"), SEED_KEYS, ids=[o.split("=")[0] for o, _ in SEED_KEYS])
def test_every_key_of_ragens_docs_translates(override, expected):
    assert flat(parse_overrides([override])) == expected
    (line,) = ragen_translation([override])
    assert line.startswith(override.split("=")[0] + "=")
    assert ("ignored" in line or "nothing to set" in line) if not expected else all(k in line for k in expected)


def test_ragens_probe_command_pasted_whole():
    cfg = make_config("sokoban-ppo", overrides=PROBE_COMMAND)
    assert (cfg.model.path, cfg.log.name, cfg.log.run_dir) == (
        "Qwen/Qwen2.5-3B", "sokoban-PPO-filter-topp09-grad-from-ckpt100", "model_saving/probe")
    assert cfg.checkpoint.resume == "/ABS/PATH/TO/your_run/global_step_100" and cfg.train.steps == 101
    assert (cfg.checkpoint.every, cfg.checkpoint.save_last, cfg.val.before_train, cfg.val.every) == (0, False, False, 0)
    assert (cfg.train.env_groups, cfg.train.group_size) == (32, 16)
    assert cfg.algo.kl_coef == 0.0, "use_kl_loss=False: RAGEN trains without the KL loss whatever kl_loss_coef says"
    assert (cfg.algo.kl_type, cfg.algo.entropy_coef, cfg.algo.loss_agg_mode) == ("low_var_kl", 0.001, "token-mean")
    assert (cfg.filter.strategy, cfg.filter.value, cfg.filter.prob_mode, cfg.filter.keep, cfg.filter.metric,
            cfg.filter.include_zero, cfg.filter.loss_scaling) == ("top_p", 0.9, "softmax", "largest", "reward_std",
                                                                  True, "none")
    assert cfg.algo.adv_estimator == "gae"
    assert (cfg.analysis.enabled, cfg.analysis.every, cfg.analysis.exit_after, cfg.analysis.num_buckets,
            cfg.analysis.bucket_mode) == (True, 1, True, 6, "quantile")
    lines = ragen_translation(PROBE_COMMAND)
    assert len(lines) == len(PROBE_COMMAND)  # one line per RAGEN key
    assert "actor_rollout_ref.actor.kl_loss_coef=0.001 -> no effect" in "\n".join(lines)


def test_use_kl_loss_false_wins_in_any_order_and_explicit_keys_come_after():
    ours = ["algo.kl_coef=0.05"]
    for order in (["actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.kl_loss_coef=0.01"],
                  ["actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.use_kl_loss=False"]):
        assert make_config(overrides=order).algo.kl_coef == 0.0
        assert make_config(overrides=order + ours).algo.kl_coef == 0.05  # a later override of ours still wins
    on = ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01"]
    assert make_config(overrides=on).algo.kl_coef == 0.01
    (alone,) = ragen_translation(on[1:])
    assert "only with actor_rollout_ref.actor.use_kl_loss=True" in alone


def test_env_tag_keys_map_to_the_env_section():
    cfg = make_config(overrides=["custom_envs.CoordSokoban.env_config.dim_room=(7, 7)",
                                 "custom_envs.LargerSokoban.env_config.num_boxes=2",
                                 "custom_envs.SimpleSokoban.env_config.observation_format=coord",
                                 "custom_envs.CoordSokoban.max_actions_per_traj=8",
                                 "custom_envs.CoordSokoban.max_tokens=120"])
    assert (cfg.env.sokoban.dim_room, cfg.env.sokoban.num_boxes, cfg.env.sokoban.observation_format) == (
        [7, 7], 2, "coord")
    assert cfg.env.max_actions_per_traj == 8
    larger = make_config(overrides=["es_manager.train.env_configs.tags=[LargerSokoban]"])
    assert (larger.env.name, larger.env.sokoban.dim_room, larger.env.sokoban.num_boxes) == ("sokoban", [8, 8], 2)
    with pytest.raises(ConfigError, match="'FrozenLakeSlippery' is not available"):
        make_config(overrides=["custom_envs.FrozenLakeSlippery.env_config.size=4"])
    with pytest.raises(ConfigError, match="mixtures of env tags"):
        make_config(overrides=["es_manager.train.env_configs.n_groups=[4,4]"])


@pytest.mark.parametrize(("override", "match"), [
    ("collapse_detection.unknown_knob=5", r"no rldynamics equivalent"),
    ("reward_model.enable=True", "rewards come from the env"),
    ("actor_rollout_ref.rollout.rollout_filter_metric=entropy_variance", "entropy and length filters"),
    ("algorithm.adv_estimator=remax", "available estimators"),
    ("algorithm.use_kl_in_reward=True", "reward-side KL"),
    ("actor_rollout_ref.actor.kl_loss_type=full", "full KL"),
    ("trainer.logger=['console','mlflow']", "mlflow"),
    ("actor_rollout_ref.rollout.n=4", "group_size"),
    ("trainer.gradient_analysis_only=True", "rldyn probe <checkpoint>"),
    ("trainer.gradient_analysis_evry=1", r"no rldynamics equivalent \(did you mean trainer.gradient_analysis_every"),
])
def test_unsupported_ragen_keys_and_values_are_refused_by_name(override, match):
    with pytest.raises(ConfigError, match=match):
        parse_overrides([override])


def test_collapse_detection_keys_turn_the_diagnostics_on():
    cfg = make_config(overrides=["collapse_detection.compute_freq=5", "collapse_detection.num_samples=all",
                                 "collapse_detection.first_turn_enabled=False", "collapse_detection.ema_decay=0.8",
                                 "collapse_detection.std_eps=0.01", "collapse_detection.micro_batch_size=32"])
    c = cfg.collapse
    assert (c.enabled, c.compute_freq, c.num_samples, c.first_turn_enabled, c.ema_decay, c.std_eps,
            c.micro_batch_size) == (True, 5, 0, False, 0.8, 0.01, 32)
    assert make_config(overrides=["collapse_detection.num_samples=16"]).collapse.num_samples == 16
    assert not make_config(overrides=["collapse_detection.compute_freq=0"]).collapse.enabled
    assert not make_config().collapse.enabled


def test_conflicting_ragen_keys_and_hydra_prefixes():
    with pytest.raises(ConfigError, match="critic.ppo_mini_batch_size set train.mini_batch_size to different"):
        parse_overrides(["actor_rollout_ref.actor.ppo_mini_batch_size=32", "critic.ppo_mini_batch_size=16"])
    assert flat(parse_overrides(["+train.lr=0.5", "++trainer.total_training_steps=7"])) == {
        "train.lr": "0.5", "train.steps": 7}  # our keys keep the typed text (converted by the field's type)
    assert make_config(overrides=["++train.steps=3", "critic.lr=0.5"]).train.steps == 3  # ours pass through
    with pytest.raises(ConfigError, match="deletions"):
        parse_overrides(["~trainer.logger"])


def test_cli_prints_the_translation_once_and_lists_the_table(capsys, tmp_path):
    keys = ["actor_rollout_ref.rollout.rollout_filter_value=0.9", "es_manager.train.env_groups=8", "train.nokey=1"]
    assert main(["train", *keys, f"log.run_dir={tmp_path}"]) == 2  # a bad key of ours: nothing runs
    out, err = capsys.readouterr()
    assert out.count("actor_rollout_ref.rollout.rollout_filter_value=0.9 -> filter.value=0.9") == 1
    assert "es_manager.train.env_groups=8 -> train.env_groups=8" in out and "train.nokey" in err
    assert not list(tmp_path.iterdir())
    assert main(["train", "--help-config", "--ragen"]) == 0
    table = capsys.readouterr().out
    assert all(key in table for key in RAGEN_KEYS) and f"custom_envs.{SOKOBAN_TAG}.env_config.dim_room" in table
    assert main(["train", "--help-config"]) == 0
    assert "--ragen" in capsys.readouterr().out


def test_every_target_is_a_config_key():
    from rldynamics.config import all_keys

    known = set(all_keys())
    for key, rule in RAGEN_KEYS.items():
        for target in filter(None, (t.split(" ")[0] for t in rule.target.split(", "))):
            assert target in known, (key, target)


@pytest.mark.parametrize(("override", "expected"), [
    ("lora.rank=8", {"model.lora.rank": 8}),
    ("lora.alpha=32", {"model.lora.alpha": 32}),
    ("lora.target_modules=all-linear", {"model.lora.target_modules": ["all-linear"]}),
    ("actor_rollout_ref.model.lora_rank=16", {"model.lora.rank": 16}),
    ("actor_rollout_ref.model.lora_alpha=16", {"model.lora.alpha": 16}),
    ("actor_rollout_ref.model.target_modules=[q_proj,v_proj]", {"model.lora.target_modules": ["q_proj", "v_proj"]}),
])
def test_lora_keys_of_ragen_and_verl_translate(override, expected):
    assert flat(parse_overrides([override])) == expected
    lora = make_config(overrides=[override]).model.lora
    assert all(getattr(lora, k.split(".")[-1]) == v for k, v in expected.items())
    with pytest.raises(ConfigError, match="no rldynamics equivalent"):
        parse_overrides(["lora.local_temp_dir=/tmp"])  # RAGEN's `lora` section: other keys refused by name
