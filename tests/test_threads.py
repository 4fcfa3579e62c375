"""The CPU thread count of a run (`rldynamics.threads`) and the record of what computed it (`environment.jsonl`)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from rldynamics.config import make_config
from rldynamics.sweep.launch import make_slots
from rldynamics.threads import auto_ranks, choose_threads, rank_threads
from rldynamics.tracking.environment import read_environment, weights_sha256
from rldynamics.train.trainer import train


@pytest.mark.parametrize("setting, environ, cores, expected", [
    (0, {}, 2, 1), (0, {}, 1, 1), (0, {}, 6, 3), (0, {}, 64, 4),  # half of the cores, at most 4
    (0, {"OMP_NUM_THREADS": "3"}, 2, 3),  # an exported OMP_NUM_THREADS is honoured
    (2, {"OMP_NUM_THREADS": "3"}, 16, 2),  # model.threads wins over both
    (0, {"OMP_NUM_THREADS": "x"}, 8, 4),  # a value that is no thread count is ignored
])
def test_thread_count_precedence(setting, environ, cores, expected):
    assert choose_threads(setting, environ, cores)[0] == expected


@pytest.mark.parametrize("cores, chosen, ranks, threads", [
    (2, False, 2, 1), (1, False, 1, None), (2, True, 1, None), (4, False, 2, 1), (8, False, 2, 2), (64, False, 2, 4)])
def test_nproc_auto_takes_two_ranks_on_two_cores_unless_a_thread_count_is_chosen(cores, chosen, ranks, threads):
    assert auto_ranks(cores, threads_chosen=chosen) == ranks
    if threads:
        assert rank_threads(cores, ranks) == threads  # half of each rank's share, at least 1


@pytest.mark.parametrize("overrides, environ, ranks", [
    ([], {}, 2), (["model.threads=1"], {}, 1), ([], {"OMP_NUM_THREADS": "1"}, 1), ([], {"WORLD_SIZE": "2"}, 1),
    (["rollout.engine=vllm"], {}, 1), (["train.env_groups=1"], {}, 1), (["rollout.staleness=1"], {}, 1),
    (["model.device=cuda"], {}, 1)])
def test_nproc_auto_is_one_process_where_two_ranks_do_not_apply(overrides, environ, ranks, monkeypatch):
    from rldynamics import cli, memory, threads

    for key in ("OMP_NUM_THREADS", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(memory, "available_memory", lambda: 4 * 2**30)  # too little for two engines and replicas
    assert cli._auto_nproc(make_config(overrides=overrides))[0] == ranks


def test_nproc_auto_with_vllm_takes_two_ranks_where_the_memory_holds_an_engine_each(monkeypatch, capsys):
    """An engine and a replica per rank: two ranks where the machine's available memory holds twice the estimate of
    one (`engine_rank_bytes`: 2 GiB for the tiny model, 1 GiB of it the KV cache) and a quarter more, else one process
    with a line that gives both figures and what `--nproc 2` would do; the same without figures for a model it cannot
    count."""
    from rldynamics import cli, memory, threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    vllm = make_config(overrides=["rollout.engine=vllm", "tiny.hidden_size=128"])
    monkeypatch.setattr(memory, "available_memory", lambda: 5.0 * 2**30)
    assert cli._auto_nproc(vllm) == (2, 1)
    assert capsys.readouterr().out == ("2 ranks of 1 torch thread on the 2 usable cores, an engine each (about 2.0 "
                                       "GiB a rank, 5.0 available) (--nproc auto; --nproc 1 runs one process)\n")
    monkeypatch.setattr(memory, "available_memory", lambda: 4.9 * 2**30)
    assert cli._auto_nproc(vllm) == (1, None)
    assert capsys.readouterr().out == ("one process with the vllm engine (--nproc auto: 2 would need about 4.0 GiB "
                                       "and a quarter to spare, 4.9 available); --nproc 2 model.shard=false trains "
                                       "on 2 ranks, an engine and a replica each: faster, about 2 times the memory\n")
    hub = make_config(overrides=["rollout.engine=vllm", "model.path=HuggingFaceTB/SmolLM2-135M"])
    assert cli._auto_nproc(hub) == (1, None)
    assert capsys.readouterr().out.startswith("one process with the vllm engine (--nproc auto); --nproc 2 ")
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert cli._auto_nproc(vllm) == (1, None)
    assert capsys.readouterr().out == ""  # one core: nothing to offer


def test_rank_memory_counts_a_micro_batch_of_rows_as_long_as_a_rollout_writes(tiny_cache):
    """`trajectory_tokens` against a real rollout of env seeds 0-3 (2-turn Sokoban games of the untrained tiny model,
    whose replies are invalid, so the second turn's user message is the one it sizes): the longest first prompt
    exactly (seed 0's alone for seeds=range(1)), the longest trajectory within a few tokens above; then a
    micro-batch's tokens and the rank's bytes by hand."""
    from conftest import micro_model_batch
    from rldynamics.rollout.agent import rollout, trajectory_tokens
    from rldynamics.rollout.sizing import RANK_ACTIVATION_BYTES, engine_rank_bytes, micro_batch_tokens

    cfg = make_config(overrides=["env.max_new_tokens=6", "env.max_turns=2"])
    model, tokenizer, batch = micro_model_batch(tiny_cache, group_size=2)
    prompt, whole = trajectory_tokens(cfg.env, tokenizer, seeds=range(4))
    torch.manual_seed(0)
    played = rollout(model, tokenizer, [0, 1, 2, 3], 2, cfg.env, temperature=1.0)
    first = played.response_mask.argmax(1)  # [8] each row's first sampled token: its prompt's length
    lengths = played.attention_mask.sum(1)  # [8]
    assert int(first.max()) == prompt and trajectory_tokens(cfg.env, tokenizer, seeds=range(1))[0] == int(first[0])
    assert int(lengths.max()) <= whole <= int(lengths.max()) + 8
    assert micro_batch_tokens(16, 8, 86, 150, shared_prefix=True) == 2 * 86 + 16 * 64
    assert micro_batch_tokens(4, 8, 86, 150, shared_prefix=True) == 86 + 4 * 64
    assert micro_batch_tokens(16, 8, 86, 150, shared_prefix=False) == 16 * 150
    assert engine_rank_bytes(100, 1.0, 10, 20) == 100 * 28 + 2 * 2**30 + 10 * 20 * RANK_ACTIVATION_BYTES


def test_rank_memory_of_a_saved_model_adds_a_reference_and_a_critic(tiny_cache, tmp_path):
    """`engine_rank_memory` on a saved model directory: its parameters, the KV cache, a micro-batch of the preset's
    rows through layers x hidden; 6 bytes a parameter more with a reference model, 24 more with a critic."""
    from conftest import micro_model_batch
    from rldynamics.models.loading import parameter_count
    from rldynamics.rollout.agent import trajectory_tokens
    from rldynamics.rollout.sizing import engine_rank_bytes, engine_rank_memory, micro_batch_tokens

    model, tokenizer, _ = micro_model_batch(tiny_cache, group_size=2)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    base = ["rollout.engine=vllm", f"model.path={tmp_path / 'm'}", "env.max_turns=2", "env.max_new_tokens=6",
            "train.micro_batch_size=4", "train.group_size=2"]
    cfg = make_config(overrides=base)
    params = parameter_count(tmp_path / "m")
    prompt, whole = trajectory_tokens(cfg.env, tokenizer)
    tokens = 2 * prompt + 4 * (whole - prompt)  # two groups' prompts once, the rest of every row
    assert micro_batch_tokens(4, 2, prompt, whole, shared_prefix=True) == tokens
    plain = engine_rank_bytes(params, 1.0, tokens, model.config.num_hidden_layers * model.config.hidden_size)
    assert engine_rank_memory(cfg) == plain
    assert engine_rank_memory(cfg, reference=True) == plain + 6 * params
    assert engine_rank_memory(make_config(overrides=[*base, "algo.adv_estimator=gae"])) == plain + 24 * params
    assert engine_rank_memory(make_config(overrides=[*base[:1], "model.path=HuggingFaceTB/SmolLM2-135M"])) is None


def test_parameters_are_counted_from_the_safetensors_headers(tmp_path):
    """`parameter_count` reads a directory's safetensors headers: the parameters the loaded model has (a tied head
    counted once), over several shard files too, and None for a directory without weights."""
    from safetensors.torch import save_file

    from rldynamics.models.loading import parameter_count
    from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(["a b c"]), hidden_size=32, num_layers=1)
    model.save_pretrained(tmp_path / "tiny")
    assert parameter_count(tmp_path / "tiny") == sum(p.numel() for p in model.parameters())
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "model-00002.safetensors"), metadata={"format": "pt"})
    assert parameter_count(tmp_path) == 12 + 5 + 8
    assert parameter_count(tmp_path / "tiny" / "missing") is None


def test_sweep_slots_honour_an_exported_thread_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert [s.env["OMP_NUM_THREADS"] for s in make_slots(parallel=1, cores=8)] == ["1"]
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert [s.env["OMP_NUM_THREADS"] for s in make_slots(parallel=1, cores=2)] == ["1"]  # the run's default
    assert [s.env["OMP_NUM_THREADS"] for s in make_slots(parallel=2, cores=16)] == ["4", "4"]


def test_run_sets_and_records_its_threads_versions_and_model(fast_overrides, capsys):
    torch.set_num_threads(2)
    run = train(make_config(overrides=[*fast_overrides, "train.steps=1", "model.threads=1"]))
    assert torch.get_num_threads() == 1
    assert capsys.readouterr().out.splitlines()[0] == (
        "device cpu, 1 torch thread (model.threads=1), compute float32 (model.dtype=auto: the embedded tiny model "
        "computes in float32)")
    (record,) = read_environment(run)
    assert (record["compute_dtype"], record["compute_dtype_reason"]) == (
        "float32", "model.dtype=auto: the embedded tiny model computes in float32")
    assert record["bf16_capability"] and record["cpu_model"]
    assert (record["threads"], record["threads_from"], record["device"], record["start_step"]) == (
        1, "model.threads=1", "cpu", 0)
    assert record["torch"] == torch.__version__ and all(record[p] for p in ("transformers", "tokenizers", "numpy"))
    assert len(record["base_model_sha256"]) == 64
    again = train(make_config(overrides=[*fast_overrides, "train.steps=1", "log.name=again"]))
    assert read_environment(again)[0]["base_model_sha256"] == record["base_model_sha256"]  # same warm start


def test_a_resume_appends_its_own_record(fast_overrides, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = train(make_config(overrides=[*fast_overrides, "train.steps=1", "log.name=r", "checkpoint.every=1"]))
    train(make_config(overrides=[*fast_overrides, "train.steps=2", "log.name=r", "checkpoint.resume=latest",
                                 "model.threads=1"]))
    assert [(r["start_step"], r["threads_from"]) for r in read_environment(run)] == [
        (0, "OMP_NUM_THREADS=1"), (1, "model.threads=1")]
    assert json.loads((run / "environment.jsonl").read_text().splitlines()[1])["threads"] == 1


def test_weights_hash_is_the_files_sha256(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert weights_sha256(tmp_path) == hashlib.sha256(b"x").hexdigest()  # what sha256sum prints
    (tmp_path / "model.safetensors").write_bytes(b"y")
    assert weights_sha256(tmp_path) == hashlib.sha256(b"y").hexdigest()


def test_nproc_auto_resumes_a_one_process_run_in_one_process(fast_overrides, monkeypatch):
    """A resumed run keeps the ranks its checkpoint was written on, so it goes on as the uninterrupted run would."""
    from rldynamics import cli, threads

    train(make_config(overrides=[*fast_overrides, "train.steps=1", "log.name=r", "checkpoint.every=1"]))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    resumed = make_config(overrides=[*fast_overrides, "train.steps=2", "log.name=r", "checkpoint.resume=latest"])
    assert cli._auto_nproc(resumed) == (1, None)
    assert cli._auto_nproc(make_config(overrides=[*fast_overrides, "log.name=new"]))[0] == 2
