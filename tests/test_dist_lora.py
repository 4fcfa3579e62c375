"""LoRA adapters over two ranks (torchrun, gloo), as replicas and FSDP2-sharded, against one process: the same
trajectories, metrics and adapter weights, a base that stays bit-identical, and adapter checkpoints that peft loads
and that resume on another number of ranks.

The run is small (tiny 1-layer model, 2 groups x 3 one-turn math replies, 3 steps, rank-4 adapters on every linear
layer) with the KL reference (the actor with its adapters off), the gradient analysis over the adapters with reward
components, a checkpoint with the merged export and a step record after each step. The tolerance is
tests/test_dist.py's (docs/multi-device.md): identical rollouts, every metric within 1e-3 relative or 1e-6
absolute, the adapters within 1e-6 in relative L2 norm and 1e-5 per entry (measured: 1e-8 and 1.5e-8, replicas and
FSDP2 alike).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_ranks
from rldynamics.config import make_config
from rldynamics.models import lora
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.train.checkpoint import verify_checkpoint
from rldynamics.train.record_io import weights_digest
from rldynamics.train.trainer import train
from test_dist import _rows, _texts

pytestmark = pytest.mark.slow  # every test here starts torchrun processes
pytest.importorskip("peft")

PRESET = "math-tiny"
RUN = ["train.steps=3", "train.env_groups=2", "train.group_size=3", "train.mini_batch_size=64",
       "train.micro_batch_size=2", "train.ppo_epochs=1", "train.lr=3e-4", "train.row_seeded_sampling=true",
       "train.shared_prefix=false", "tiny.layers=1", "tiny.hidden_size=32", "env.max_turns=1",
       "env.max_new_tokens=10", "env.math.length_target=20", "val.env_groups=2", "val.every=3",
       "val.before_train=false", "model.warm_start_episodes=8", "model.warm_start_epochs=1", "log.progress=false",
       "log.report=false", "log.samples_per_step=100", "model.lora.rank=4", "model.lora.alpha=8",
       "algo.kl_coef=0.01", "algo.entropy_coef=0.001", "analysis.enabled=true", "analysis.every=1",
       "analysis.num_buckets=2", "analysis.reward_grad=true", "checkpoint.every=1", "checkpoint.save_merged=true",
       "record.every=1"]
LAYOUTS = {"replicas": "model.shard=false", "fsdp2": "model.shard=true"}


def _adapter(run, step: int = 3) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step}" / "actor" / "adapter_model.safetensors"))


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """`b` equals `a` within the module's weight tolerance."""
    assert a.keys() == b.keys()
    diff = math.sqrt(sum(float((a[k] - b[k]).double().square().sum()) for k in a))
    size = math.sqrt(sum(float(a[k].double().square().sum()) for k in a))
    assert diff / size < 1e-6
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def _close_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert a[0].keys() == b[0].keys()
    for x, y in zip(a, b, strict=True):
        for key, value in x.items():
            # a cosine's rounding is absolute (a near-orthogonal pair's cosine of -0.027 moved by 3e-5 between
            # the reduction orders of one process and two ranks)
            near = dict(abs=1e-4) if "/cos" in key else dict(rel=1e-3, abs=1e-6)
            assert y[key] == pytest.approx(value, nan_ok=True, **near), (x["step"], key)


def _launch(root, cache: str, *overrides: str) -> None:
    run_ranks(["-m", "rldynamics.cli", "train", "--preset", PRESET, *RUN, f"log.run_dir={root}", *overrides],
              timeout=300, env={"RLDYN_CACHE": cache})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The LoRA run in one process and on two ranks, as replicas and FSDP2-sharded: (root, cache, {name: run})."""
    root = tmp_path_factory.mktemp("dist_lora")
    cache = str(root / "cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLDYN_CACHE", cache)
        one = train(make_config(PRESET, overrides=[*RUN, f"log.run_dir={root}", "log.name=one"]))  # builds the model
        for name, layout in LAYOUTS.items():
            _launch(root, cache, f"log.name={name}", layout)
        yield root, cache, {"one": one, **{name: root / name for name in LAYOUTS}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_train_the_one_process_adapters(runs, layout):
    _, _, run = runs
    one, two = run["one"], run[layout]
    assert _texts(two) == _texts(one) and len(_texts(one)) == 3 * 2 * 3
    a, b = _rows(one), _rows(two)
    assert "grad_norm/all/task" in a[0] and "reward_grad/all/cos_total/length" in a[0]
    assert all(row["grad_analysis/parameters"] == a[0]["grad_analysis/parameters"] for row in a + b)
    _close_rows(a, b)
    adapter = _adapter(two)
    assert all(".lora_A." in k or ".lora_B." in k for k in adapter)
    _close(_adapter(one), adapter)
    assert any(bool(t.abs().max() > 0) for k, t in adapter.items() if ".lora_B." in k)  # it trained
    merged = "actor_merged/model.safetensors"
    _close(load_file(str(one / "checkpoints/step_3" / merged)), load_file(str(two / "checkpoints/step_3" / merged)))
    optim = [torch.load(r / "checkpoints/step_3/optimizer.pt", weights_only=True)["actor"] for r in (one, two)]
    assert optim[1]["param_groups"] == optim[0]["param_groups"]  # the adapters alone, numbered as one process does
    _close({str(i): s["exp_avg"] for i, s in optim[0]["state"].items()},
           {str(i): s["exp_avg"] for i, s in optim[1]["state"].items()})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_base_stays_bit_identical_and_peft_loads_the_checkpoint(runs, layout):
    """Each step record holds the digest of every weight the ranks held after the step (gathered, base included):
    the base model loaded afresh with the saved adapter (`PeftModel.from_pretrained`) gives it, bit for bit."""
    from peft import PeftModel

    from rldynamics.tracking.step_records import read_record, record_path
    from rldynamics.train.setup import base_model_path, run_config

    _, _, run = runs
    for step in (1, 3):
        ckpt = run[layout] / "checkpoints" / f"step_{step}"
        verify_checkpoint(ckpt)
        base, _ = load_model_and_tokenizer(base_model_path(run_config(ckpt)))
        actor = PeftModel.from_pretrained(base, str(ckpt / "actor"))
        assert lora.is_adapted(actor)
        assert weights_digest(actor) == read_record(record_path(run[layout], step))[1]["weights_after"]
    config = json.loads((ckpt / "actor" / lora.ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8


def test_a_two_rank_checkpoint_resumes_in_one_process_and_on_two(runs, tmp_path, monkeypatch):
    """FSDP2's step-2 checkpoint resumed in one process, and the replicas' resumed on two FSDP2 ranks (the optimizer
    state read by rank 0 and sent in shards), each give the uninterrupted run's last step within the tolerance."""
    root, cache, run = runs
    monkeypatch.setenv("RLDYN_CACHE", cache)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for copy, source in ((single, run["fsdp2"]), (sharded, run["replicas"])):
        shutil.copytree(source, copy)
        shutil.rmtree(copy / "checkpoints" / "step_3")
    train(make_config(PRESET, overrides=[*RUN, f"log.run_dir={tmp_path}",
                                         f"checkpoint.resume={single / 'checkpoints' / 'step_2'}"]))
    _launch(tmp_path, cache, "model.shard=true", f"checkpoint.resume={sharded / 'checkpoints' / 'step_2'}")
    for resumed in (single, sharded):
        _close(_adapter(run["one"]), _adapter(resumed))
        _close_rows(_rows(run["one"]), _rows(resumed))
