"""AdamW's implementation (`train.optim`): the fused kernel against the per-parameter loop."""

from __future__ import annotations

import copy

import pytest
import torch

from rldynamics.config import ConfigError, make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.setup import adamw
from rldynamics.train.trainer import train

SHAPES = [(96, 32), (32,), (64, 96), (500, 32)]  # a block's matrices, a norm, an embedding


def _steps(optim: str, steps: int = 3, state: dict | None = None, params=None):
    """`steps` AdamW steps on seeded parameters and gradients; returns the parameters and the optimizer."""
    g = torch.Generator().manual_seed(0)
    params = params or [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES]
    opt = adamw(params, 1e-3, 0.01, optim)
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))  # torch keeps the given tensors: two loads would share them
    grads = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads) * 1e-2
        opt.step()
    return params, opt


def test_fused_adamw_is_the_loop_within_float32_rounding_and_deterministic():
    loop, _ = _steps("adamw_torch")
    fused, opt = _steps("adamw_torch_fused")
    again, _ = _steps("adamw_torch_fused")
    assert opt.defaults["fused"] is True
    for a, b, c in zip(loop, fused, again, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)  # a few ulps of the weights, not bit for bit
        assert torch.equal(b, c)  # the same run twice: bit for bit
    # really another kernel: with MKL's AVX2 code (AMD and AVX2-only CPUs) its weights can equal the loop's bit for
    # bit, so the check is on the kernel that ran
    assert _kernels("adamw_torch_fused") >= {"aten::_fused_adamw_"}
    assert not _kernels("adamw_torch") & {"aten::_fused_adamw_"}


def _kernels(optim: str) -> set[str]:
    """The names of the operators one `optim` step runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _steps(optim, steps=1)
    return {event.name for event in prof.events()}


def test_a_fused_state_continues_under_the_loop_and_back():
    """The two keep the same state (step, exp_avg, exp_avg_sq), so a checkpoint of one resumes under the other."""
    params, fused = _steps("adamw_torch_fused", steps=2)
    state = fused.state_dict()
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    as_loop, _ = _steps("adamw_torch", steps=1, state=state, params=[torch.nn.Parameter(p.detach().clone())
                                                                      for p in params])
    on_fused, _ = _steps("adamw_torch_fused", steps=1, state=state, params=[torch.nn.Parameter(p.detach().clone())
                                                                            for p in params])
    for a, b in zip(as_loop, on_fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)


def test_train_optim_picks_the_trainers_adamw(fast_overrides):
    runs = {optim: [r for r in read_metrics(train(make_config(overrides=[*fast_overrides, f"log.name={optim}",
                                                                         f"train.optim={optim}"])))
                    if "actor/grad_norm" in r]
            for optim in ("adamw_torch", "adamw_torch_fused")}
    loop, fused = runs["adamw_torch"], runs["adamw_torch_fused"]
    assert len(loop) == len(fused) == 2
    assert loop[0]["actor/grad_norm"] == fused[0]["actor/grad_norm"]  # the first gradient: same weights
    assert fused[1]["actor/grad_norm"] == pytest.approx(loop[1]["actor/grad_norm"], rel=1e-3)
    with pytest.raises(ConfigError, match="train.optim"):
        make_config(overrides=["train.optim=sgd"])


def test_a_resumed_optimizer_takes_the_configs_implementation():
    """torch's `load_state_dict` brings back the saved `fused` flag; a run follows its config instead (a checkpoint
    written before `train.optim` existed holds the loop's)."""
    from rldynamics.train.setup import set_optimizer_settings

    params, loop = _steps("adamw_torch", steps=1)
    resumed = adamw(params, 1e-3, 0.01, "adamw_torch_fused")
    resumed.load_state_dict(loop.state_dict())
    assert resumed.param_groups[0]["fused"] is False
    set_optimizer_settings(make_config(overrides=["train.lr=1e-3"]), resumed)
    assert resumed.param_groups[0]["fused"] is True and resumed.param_groups[0]["lr"] == 1e-3
    set_optimizer_settings(make_config(overrides=["train.optim=adamw_torch"]), resumed)
    assert resumed.param_groups[0]["fused"] is False
