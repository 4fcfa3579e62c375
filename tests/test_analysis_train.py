"""The gradient analysis inside training runs: read-only, cadence, exit_after, separate batch, checkpoint probe."""

from __future__ import annotations

import csv
import json

from safetensors.torch import load_file

from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.probe import probe_checkpoint
from rldynamics.train.trainer import train

ANALYSIS = ["analysis.enabled=true", "analysis.every=1", "analysis.num_buckets=2", "algo.kl_coef=0.01",
            "algo.entropy_coef=0.01"]


def _weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "actor" / "model.safetensors"))


def _same_weights(a, b):
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_analysis_every_step_leaves_training_bit_identical(fast_overrides):
    on = train(make_config(overrides=[*fast_overrides, "log.name=on", *ANALYSIS]))
    off = train(make_config(overrides=[*fast_overrides, "log.name=off", *ANALYSIS[1:]]))
    assert _same_weights(_weights(on, 2), _weights(off, 2))
    rows = read_metrics(on)
    for key in ("grad_norm/all/task", "grad_norm/all/entropy", "grad_norm/all/kl", "grad_norm/all/raw/kl",
                "grad_norm/bucket_1/task", "grad_norm/bucket_1/per_sample/task", "grad_norm/all/cos/task_entropy",
                "grad_norm/all/reg_share", "actor/grad_norm/task", "actor/loss/total"):
        assert key in rows[1] and key in rows[2], key
    table = list(csv.DictReader(open(on / "analysis" / "step_1" / "groups.csv")))
    assert {r["bucket"] for r in table} <= {"bucket_1", "bucket_2"} and len(table) == 2  # 2 groups
    sketches = load_file(str(on / "analysis" / "step_1" / "sketches.safetensors"))
    assert "grad_norm/all/task" in sketches and sketches["grad_norm/all/task"].shape == (1024,)


def test_exit_after_stops_before_any_update(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, "log.name=exit", *ANALYSIS, "analysis.exit_after=true",
                                       "algo.adv_estimator=gae",
                                       "checkpoint.save_last=true"]))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["trainer/exited_after_gradient_analysis"] == 1.0
    assert "actor/pg_loss" not in rows[1] and "critic/vf_loss" in rows[1]  # critic runs before the analysis
    assert not (run / "checkpoints").exists()


def test_separate_batch_with_prefilter(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, "log.name=sep", *ANALYSIS, "analysis.env_groups=3",
                                       "analysis.group_size=2", "analysis.prefilter=true", "analysis.only=true",
                                       "train.steps=1", "filter.strategy=top_k_abs", "filter.value=1"]))
    row = read_metrics(run)[-1]
    assert row["grad_analysis/uses_training_batch"] == 0.0
    assert row["grad_analysis/source_batch_size"] == 6.0
    assert row["grad_analysis/filter_kept_count"] == 1.0
    assert row["grad_norm_prefilter/all/sample_count"] == 6.0 and row["grad_norm/all/sample_count"] == 2.0
    assert "actor/pg_loss" not in row and "critic/vf_loss" not in row  # probe mode updates nothing
    metrics = json.loads((run / "analysis" / "step_1" / "metrics.json").read_text())
    assert metrics["grad_norm/all/task"] == row["grad_norm/all/task"]


def test_probe_on_checkpoint_reproduces_the_step(fast_overrides, tmp_path):
    run = train(make_config(overrides=[*fast_overrides, "log.name=src", *ANALYSIS[:1], "analysis.every=2",
                                       "train.steps=3", "checkpoint.every=2", "algo.kl_coef=0.01",
                                       "algo.entropy_coef=0.01", "analysis.num_buckets=2"]))
    trained = read_metrics(run)[3]  # step 3 analysed the batch the step-2 weights produced
    probe = probe_checkpoint(run / "checkpoints" / "step_2", ["algo.kl_coef=0.01", "algo.kl_type=low_var_kl",
                                                              "algo.entropy_coef=0.01"])
    probed = read_metrics(probe)[-1]
    assert probed["step"] == 3
    keys = [k for k in trained if k.startswith("grad_norm/")]
    assert keys
    for k in keys:
        assert abs(probed[k] - trained[k]) <= 1e-6 * max(1.0, abs(trained[k])), k
