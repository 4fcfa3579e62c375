"""The logged names are an interface (RAGEN's and verl's, and every earlier run directory): the owner's constants
and builders spell exactly these strings."""

from __future__ import annotations

from rldynamics import metric_names as names


def test_names_are_spelled_as_logged():
    assert {k: getattr(names, k) for k in ("ENTROPY", "PG_LOSS", "PG_CLIPFRAC", "KL_LOSS", "ACTOR_GRAD_NORM",
                                           "SKIPPED_STEPS", "ACTOR_LR", "KL_COEF", "CRITIC_WARMUP", "BATCH_SIZE",
                                           "EMPTY_AFTER_FILTER", "REF_LOG_PROB", "SCORE_MEAN", "RESPONSE_LENGTH_MEAN",
                                           "RETURNS_MEAN", "RETURNS_VAR", "VALUES_MEAN", "VF_EXPLAINED_VAR",
                                           "VF_RESIDUAL_VAR", "LOSS_TOTAL", "REWARD_STATS")} == {
        "ENTROPY": "actor/entropy", "PG_LOSS": "actor/pg_loss", "PG_CLIPFRAC": "actor/pg_clipfrac",
        "KL_LOSS": "actor/kl_loss", "ACTOR_GRAD_NORM": "actor/grad_norm", "SKIPPED_STEPS": "actor/skipped_steps",
        "ACTOR_LR": "actor/lr", "KL_COEF": "actor/kl_coef", "CRITIC_WARMUP": "critic/warmup",
        "BATCH_SIZE": "train/batch_size", "EMPTY_AFTER_FILTER": "rollout/empty_after_filter",
        "REF_LOG_PROB": "rollout/ref_log_prob", "SCORE_MEAN": "critic/score/mean",
        "RESPONSE_LENGTH_MEAN": "response_length/mean", "RETURNS_MEAN": "critic/returns/mean",
        "RETURNS_VAR": "critic/returns/var", "VALUES_MEAN": "critic/values/mean",
        "VF_EXPLAINED_VAR": "critic/vf_explained_var", "VF_RESIDUAL_VAR": "critic/vf_residual_var",
        "LOSS_TOTAL": "loss/total", "REWARD_STATS": "reward_stats"}
    assert [names.score("max"), names.advantages("min"), names.response_length("max")] == [
        "critic/score/max", "critic/advantages/min", "response_length/max"]
    assert names.critic("vf_loss") == "critic/vf_loss" and names.loss("policy") == "loss/policy"
    assert names.env_metric("math", "success") == "train/math/success" == names.env_metric("math", names.SUCCESS)
    assert names.val_success("math") == "val-env/math/success" == names.env_metric("math", "success", validation=True)
    assert names.parse_env_metric(names.env_metric("math", "reward_func_errors", validation=True)) == (
        True, "math", "reward_func_errors")
