"""The gradient analysis inside training runs: read-only, cadence, exit_after, separate batch, checkpoint probes."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rldynamics.cli import main
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
                "grad_norm/bucket_0/task", "grad_norm/bucket_0/per_sample/task", "grad_norm/all/cos/task_entropy",
                "grad_norm/all/reg_share", "actor/grad_norm/task", "actor/loss/total"):
        assert key in rows[1] and key in rows[2], key
    table = list(csv.DictReader(open(on / "analysis" / "step_1" / "groups.csv")))
    assert {r["bucket"] for r in table} == {"bucket_0"} and len(table) == 2  # 2 groups, no answer in format: RV = 0
    sketches = load_file(str(on / "analysis" / "step_1" / "sketches.safetensors"))
    assert "grad_norm/all/task" in sketches and sketches["grad_norm/all/task"].shape == (1024,)


def test_chunked_analysis_logs_what_the_whole_analysis_logs(fast_overrides):
    """`analysis.memory_chunks` changes the probe's memory, not what it logs or what training does."""
    extra = ["analysis.per_group=true", "analysis.bootstrap_resamples=50", "train.steps=2"]
    whole = train(make_config(overrides=[*fast_overrides, "log.name=whole", *ANALYSIS, *extra]))
    chunked = train(make_config(overrides=[*fast_overrides, "log.name=chunked", *ANALYSIS, *extra,
                                           "analysis.memory_chunks=3"]))
    assert _same_weights(_weights(whole, 2), _weights(chunked, 2))
    for a, b in zip(read_metrics(whole)[1:], read_metrics(chunked)[1:], strict=True):
        probed = {k: v for k, v in a.items() if k.startswith(("grad_norm/", "actor/grad_norm/"))}
        assert len(probed) > 20
        assert {k: b[k] for k in probed} == pytest.approx(probed, rel=1e-9, abs=1e-12, nan_ok=True)
    for step in (1, 2):
        ours = load_file(str(chunked / "analysis" / f"step_{step}" / "sketches.safetensors"))
        theirs = load_file(str(whole / "analysis" / f"step_{step}" / "sketches.safetensors"))
        assert ours.keys() == theirs.keys()
        for key, sketch in theirs.items():
            torch.testing.assert_close(ours[key], sketch, rtol=1e-6, atol=1e-6 * float(sketch.abs().max()))


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
                                       "analysis.group_size=2", "analysis.prefilter=true", "analysis.exit_after=true",
                                       "train.steps=1", "filter.strategy=top_k_abs", "filter.value=1",
                                       "analysis.per_group=true", "analysis.bootstrap_resamples=50"]))
    row = read_metrics(run)[-1]
    assert row["grad_analysis/uses_training_batch"] == 0.0
    assert row["grad_analysis/source_batch_size"] == 6.0
    assert row["grad_analysis/filter_kept_count"] == 1.0
    assert row["grad_norm_prefilter/all/sample_count"] == 6.0 and row["grad_norm/all/sample_count"] == 2.0
    assert "actor/pg_loss" not in row and "critic/vf_loss" not in row  # the analysis comes before any update
    metrics = json.loads((run / "analysis" / "step_1" / "metrics.json").read_text())
    assert metrics["grad_norm/all/task"] == row["grad_norm/all/task"]
    # per group: every analysed group's own norms in groups.csv, and intervals for the 3-group bucket
    table = [r for r in csv.DictReader(open(run / "analysis" / "step_1" / "groups.csv"))]
    assert len(table) == 4 and all(r["task"] != "" and float(r["raw/entropy"]) > 0 for r in table)  # 3 + 1 kept
    assert row["grad_norm_prefilter/bucket_0/group_rv_count"] == 3.0
    head = "grad_norm_prefilter/bucket_0/raw/entropy"
    assert row[f"{head}/ci_low"] <= row[head] <= row[f"{head}/ci_high"]


# A warm start that answers in format often enough for rewards to vary within groups (the FAST one never does),
# so reward-variance early stopping can fire and the analysed task gradients are not all zero.
VARIED = ["model.warm_start_epochs=15", "model.warm_start_lr=5e-3", "train.group_size=4", "val.every=0"]


def _seeds(run_dir, step, prefix="grad_norm"):
    rows = csv.DictReader(open(run_dir / "analysis" / f"step_{step}" / "groups.csv"))
    return sorted(int(r["seed"]) for r in rows if r["prefix"] == prefix)


def test_probes_of_a_collapsed_run_analyse_its_checkpoints_on_the_same_puzzles(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, *VARIED, "log.name=collapsed", "train.steps=4",
                                       "checkpoint.every=1", "early_stop.rv_baseline_steps=1", "early_stop.rv_window=2",
                                       "early_stop.rv_ratio=1000"]))
    rows = read_metrics(run)
    assert rows[1]["rollout/in_group_reward_std"] > 0, "the baseline needs reward variance"
    assert rows[-1]["step"] == 3 and rows[-1]["early_stopped/reward_variance_collapse"] == 1.0  # before its update
    probes = {step: probe_checkpoint(run / "checkpoints" / f"step_{step}", []) for step in (1, 3)}
    for step, probe in probes.items():
        (row,) = read_metrics(probe)
        assert row["step"] == step  # the checkpoint's step, as RAGEN's probe
        assert row["grad_norm/all/sample_count"] == 8.0 and row["trainer/exited_after_gradient_analysis"] == 1.0
        assert not [k for k in row if k.startswith("early_stopped/")]
        assert not (probe / "checkpoints").exists(), "a probe never writes checkpoints"
        assert _seeds(probe, step) == [10000, 10001]  # step 1's puzzles, whatever the checkpoint
        samples = [json.loads(line)["seed"] for line in (probe / "samples.jsonl").read_text().splitlines()]
        assert set(samples) <= {10000, 10001}
    a, b = (read_metrics(probes[s])[-1] for s in (1, 3))
    assert a["grad_norm/all/loss/entropy"] != b["grad_norm/all/loss/entropy"]  # step 2 updated: another policy
    with pytest.raises(ValueError, match="rldyn probe"):  # probe mode never logs into the checkpointed run
        train(make_config(overrides=[*fast_overrides, f"checkpoint.resume={run / 'checkpoints' / 'step_1'}",
                                     "analysis.only=true"]))


def test_probe_of_unchanged_weights_reproduces_the_first_analysis(fast_overrides):
    """With lr 0 every checkpoint holds the initial weights; a probe of the last one must analyse exactly what
    the run analysed at step 1 (same env seeds, same sampling seeds, same loss settings), here on a separate
    analysis batch."""
    probe_losses = ["algo.kl_coef=0.001", "algo.kl_type=k3", "algo.entropy_coef=0.001"]  # the probe's defaults
    separate = ["analysis.env_groups=3", "analysis.group_size=2", "analysis.num_buckets=2"]
    run = train(make_config(overrides=[*fast_overrides, "log.name=still", "train.lr=0", "val.every=0", *ANALYSIS[:1],
                                       "analysis.every=10", *separate, *probe_losses]))
    trained = read_metrics(run)[1]
    probe = probe_checkpoint(run / "checkpoints" / "step_2", separate)
    probed = read_metrics(probe)[-1]
    assert probed["step"] == 2 and _seeds(probe, 2) == _seeds(run, 1) == [510000, 510001, 510002]
    keys = [k for k in trained if k.startswith("grad_norm/")]
    assert len(keys) > 50 and trained["grad_norm/all/raw/entropy"] > 0  # depends on every sampled token
    for k in keys:
        assert probed[k] == pytest.approx(trained[k], rel=1e-6, abs=1e-9, nan_ok=True), k


def test_probe_reference_is_the_base_model_of_the_checkpoints_run(fast_overrides):
    """The KL reference of a probe is the base model of the checkpoint's run, built from that run's config.yaml:
    a probe's own settings that the warm start depends on (its seed and env keys) never make another one. With lr 0
    the actor is that base model, so the KL gradient is exactly zero, whatever the probe's settings."""
    run = train(make_config(overrides=[*fast_overrides, "log.name=base", "train.lr=0", "val.every=0",
                                       "train.steps=1", "tiny.hidden_size=32"]))
    for name, overrides in (("same", []), ("other", ["seed=7", "env.max_new_tokens=4"])):
        probe = probe_checkpoint(run / "checkpoints" / "step_1", [*overrides, f"log.name={name}"])
        row = read_metrics(probe)[-1]
        assert row["grad_norm/all/raw/entropy"] > 0 and row["grad_norm/all/raw/kl"] == 0.0, name


def test_probe_refuses_to_pair_the_actor_with_another_reference(fast_overrides, tmp_path, capsys):
    """Whatever would pair the checkpoint's actor with a reference other than its run's base model is refused in
    one line, before anything is written: an override of what the base model is made of, a checkpoint without its
    run's config.yaml (the reference is then unknown), and a checkpoint copied into a run of another model."""
    narrow = train(make_config(overrides=[*fast_overrides, "log.name=narrow", "val.every=0", "train.steps=1",
                                          "tiny.hidden_size=32"]))
    wide = train(make_config(overrides=[*fast_overrides, "log.name=wide", "val.every=0", "train.steps=1"]))
    checkpoint = narrow / "checkpoints" / "step_1"
    loose = tmp_path / "loose" / "step_1"
    shutil.copytree(checkpoint, loose)
    shutil.copytree(checkpoint, wide / "checkpoints" / "step_9")
    probes = tmp_path / "probes"
    cases = [(checkpoint, ["tiny.hidden_size=64"], "tiny.hidden_size"),
             (checkpoint, [f"actor_rollout_ref.model.path={wide / 'checkpoints' / 'step_1' / 'actor'}"], "model.path"),
             (loose, [], f"{loose.parent.parent / 'config.yaml'} is missing"),
             (wide / "checkpoints" / "step_9", [], "not the architecture of the base model")]
    for path, overrides, named in cases:
        capsys.readouterr()
        assert main(["probe", str(path), *overrides, f"log.run_dir={probes}"]) == 2, (path, overrides)
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("rldyn probe: ") and named in err, err
        assert not probes.exists()


def test_packed_rows_give_the_analysis_and_the_update_of_padded_rows(fast_overrides):
    """`train.shared_prefix` (each prompt once, the rest packed without padding) against whole padded rows: the
    same step-1 batch gives the same gradient analysis and update figures within float tolerance."""
    extra = [*ANALYSIS, *VARIED, "train.steps=1", "train.micro_batch_size=4", "train.mini_batch_size=8"]
    packed = train(make_config(overrides=[*fast_overrides, "log.name=packed", *extra]))
    padded = train(make_config(overrides=[*fast_overrides, "log.name=padded", *extra, "train.shared_prefix=false"]))
    a, b = read_metrics(packed)[1], read_metrics(padded)[1]
    figures = {k: v for k, v in a.items() if k.startswith(("grad_norm/", "actor/")) and isinstance(v, float)}
    assert len(figures) > 20 and a["grad_norm/all/task"] > 0
    assert {k: b[k] for k in figures} == pytest.approx(figures, rel=1e-4, abs=1e-6, nan_ok=True)
    # Adam's first step moves a weight by lr wherever |gradient| >> eps (1e-8); the few weights whose gradient is of
    # eps's size move by a fraction of lr that the summation order sets, so they may differ by a fraction of lr (a
    # packing error would move many weights by ~2 lr)
    lr = make_config(overrides=fast_overrides).train.lr
    packed_weights = _weights(packed, 1)
    for name, weight in _weights(padded, 1).items():
        diff = (packed_weights[name] - weight).abs()
        assert diff.max() < lr / 4 and (diff > 1e-6).float().mean() < 1e-3, name
