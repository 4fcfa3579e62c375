"""GPU checks (marker `gpu`; skipped without CUDA): bf16 training with the analysis, the probe's CUDA RNG fork,
FSDP2 over NCCL against one GPU. The CPU suite covers the same code paths with gloo and float32."""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_ranks
from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train
from test_dist import PRESET, RUN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _actor(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step}" / "actor" / "model.safetensors"))


def test_bf16_training_with_the_analysis_on_a_gpu(fast_overrides):
    run = train(make_config(PRESET, overrides=[*fast_overrides, *RUN, "model.device=cuda", "model.dtype=bfloat16",
                                               "log.name=bf16"]))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("actor/pg_loss", "critic/vf_loss", "grad_norm/all/task", "grad_norm/all/raw/kl"):
        assert all(math.isfinite(r[key]) for r in rows), key
    weights = _actor(run, 3)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())  # float32 master weights


def test_the_probe_leaves_the_cuda_rng_as_it_found_it(fast_overrides):
    """The analysis is read-only on a GPU too: the CUDA RNG is forked, so a run with it ends with the weights of the
    run without it, bit for bit (global-stream sampling draws from the CUDA RNG there)."""
    common = [*fast_overrides, *RUN, "model.device=cuda", "train.row_seeded_sampling=false"]
    with_analysis = train(make_config(PRESET, overrides=[*common, "log.name=on"]))
    without = train(make_config(PRESET, overrides=[*common, "log.name=off", "analysis.enabled=false"]))
    a, b = _actor(with_analysis, 3), _actor(without, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fsdp2_over_nccl_gives_the_one_gpu_run(fast_overrides, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    common = [*fast_overrides, *RUN, "model.device=cuda", f"log.run_dir={tmp_path}"]
    one = train(make_config(PRESET, overrides=[*common, "log.name=one"]))
    run_ranks(["-m", "rldynamics.cli", "train", "--preset", PRESET, *common, "log.name=two"], timeout=600,
              env={"RLDYN_CACHE": os.environ["RLDYN_CACHE"]})  # the tiny model is cached by now
    a, b = _actor(one, 3), _actor(tmp_path / "two", 3)
    diff = math.sqrt(sum(float((a[k] - b[k]).double().square().sum()) for k in a))
    size = math.sqrt(sum(float(a[k].double().square().sum()) for k in a))
    assert diff / size < 1e-5  # GPU kernels add their own rounding to the CPU tolerance of test_dist

