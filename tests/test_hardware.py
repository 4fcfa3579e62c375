"""The compute dtype rule (`models.hardware`): bfloat16 only where the device computes it fast, float32 elsewhere."""

from __future__ import annotations

import json

import pytest
import torch

from rldynamics.config import make_config
from rldynamics.models import hardware
from rldynamics.models.hardware import Bf16Speed, bf16_speed, choose_dtype
from rldynamics.train.setup import choose_precision

AMX = Bf16Speed("cpu", "AMX", fast=True, factor=6.0)
AVX2 = Bf16Speed("cpu", "AVX2", fast=False, factor=0.03)


@pytest.fixture
def fake_cpu(monkeypatch, tmp_path):
    """A CPU whose capability and measured bfloat16 factor the test sets; counts the measurements."""
    calls = []

    def fake(capability: str, factor: float) -> None:
        monkeypatch.setattr(hardware, "cpu_capability", lambda: capability)
        monkeypatch.setattr(hardware, "matmul_factor", lambda: calls.append(1) or factor)

    monkeypatch.setenv("RLDYN_CACHE", str(tmp_path))
    return fake, calls


def test_auto_is_bfloat16_only_where_it_is_fast():
    assert choose_dtype("model.dtype", "auto", AMX).name == "bfloat16"
    assert choose_dtype("model.dtype", "auto", AMX).reason == "model.dtype=auto: AMX, bfloat16 matmul 6.00x float32"
    slow = choose_dtype("model.dtype", "auto", AVX2)
    assert (slow.name, slow.warning) == ("float32", None)
    assert slow.reason == "model.dtype=auto: no fast bfloat16 on this device (AVX2, bfloat16 matmul 0.03x float32)"
    assert choose_dtype("model.dtype", "auto", AMX, tiny=True).name == "float32"  # the tiny model: always float32
    assert choose_dtype("model.dtype", "auto", Bf16Speed("cuda", "cuda sm_90", fast=True)).name == "bfloat16"


def test_an_explicit_dtype_is_kept_and_a_slow_bfloat16_warns_with_its_factor():
    assert choose_dtype("model.dtype", "float32", AMX).name == "float32"
    fast = choose_dtype("model.dtype", "bfloat16", AMX)
    assert (fast.name, fast.warning) == ("bfloat16", None)
    slow = choose_dtype("rollout.vllm_dtype", "bfloat16", AVX2)
    assert slow.name == "bfloat16"
    assert "0.03x float32" in slow.warning and "rollout.vllm_dtype=auto computes in float32" in slow.warning
    with pytest.raises(ValueError, match="float16"):
        choose_dtype("model.dtype", "float16", AMX)


def test_a_cpu_without_bfloat16_instructions_is_slow_without_measuring(fake_cpu):
    fake, calls = fake_cpu
    fake("AVX2", 0.03)
    speed = bf16_speed(torch.device("cpu"))
    assert (speed.capability, speed.fast, speed.factor, calls) == ("AVX2", False, None, [])
    assert bf16_speed(torch.device("cpu"), measure_slow=True).factor == 0.03  # measured only to word a warning


def test_a_cpu_with_bfloat16_instructions_is_measured_once_and_cached(fake_cpu, tmp_path):
    fake, calls = fake_cpu
    fake("AVX512_BF16", 2.5)
    assert bf16_speed(torch.device("cpu")) == Bf16Speed("cpu", "AVX512_BF16", fast=True, factor=2.5)
    assert bf16_speed(torch.device("cpu")).factor == 2.5 and len(calls) == 1  # the second read the cache
    (cached,) = (tmp_path / "hardware").glob("bf16-*.json")
    assert json.loads(cached.read_text())["factor"] == 2.5
    cached.write_text("{not json")  # a damaged cache entry is measured again, not an error
    assert bf16_speed(torch.device("cpu")).factor == 2.5 and len(calls) == 2


def test_native_instructions_that_measure_slow_are_not_fast(fake_cpu):
    fake, _ = fake_cpu
    fake("AMX", 1.05)  # below FAST_FACTOR: autocast's casts would eat the gain
    assert not bf16_speed(torch.device("cpu")).fast


def test_the_measured_factor_is_a_real_ratio_of_rates():
    factor = hardware.matmul_factor(repeats=1)
    assert 0.001 < factor < 100
    assert torch.get_num_threads() >= 1


@pytest.mark.parametrize("capability, factor, model_dtype, engine_dtype", [
    ("AVX2", 0.03, "float32", "float32"), ("AMX", 6.0, "bfloat16", "bfloat16")])
def test_smollm2_presets_resolve_by_the_hardware(fake_cpu, capability, factor, model_dtype, engine_dtype):
    """`math-smollm2` (and `rldyn eval` of it) computes in float32 with no override where bfloat16 is slow."""
    fake, _ = fake_cpu
    fake(capability, factor)
    cfg = make_config("math-smollm2", overrides=["rollout.engine=vllm"])
    precision = choose_precision(cfg, torch.device("cpu"))
    assert (precision.model.name, precision.engine_dtype) == (model_dtype, engine_dtype)
    assert precision.record()["bf16_capability"] == capability
    tiny = choose_precision(make_config("sokoban-tiny"), torch.device("cpu"))
    assert tiny.model.name == "float32" and tiny.engine is None


def test_the_tiny_model_on_auto_times_nothing(fake_cpu):
    """Its choice is float32 whatever the CPU, so a start does not measure bfloat16 for it."""
    fake, calls = fake_cpu
    fake("AVX512_BF16", 2.5)
    precision = choose_precision(make_config("sokoban-tiny"), torch.device("cpu"))
    assert (precision.model.name, precision.speed.factor, calls) == ("float32", None, [])
    assert choose_precision(make_config("sokoban-tiny", overrides=["model.dtype=bfloat16"]),
                            torch.device("cpu")).speed.factor == 2.5 and calls == [1]  # asked for: measured
