"""bench/doctors.py's conversion of a run's logs into the stand-alone RL doctors' inputs, on a tiny synthetic run
directory (the tools themselves are not needed: they live in their own environment, `bench/doctors_tools.py`)."""

import importlib
import json
import sys
from pathlib import Path

import pytest
import yaml

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def doctors():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("doctors")
    finally:
        sys.path.remove(str(BENCH))


def write_run(path: Path, kl_coef: float = 0.0, val_temperature: float = 0.5) -> Path:
    """Steps 0-4 of a math run: 2 groups of 2 trajectories a step; the reference KL logged on step 1 only (a
    gradient-analysis step), as a run without a KL term logs it."""
    path.mkdir()
    cfg = {"algo": {"adv_estimator": "grpo", "kl_coef": kl_coef, "entropy_coef": 0.0, "clip_low": 0.2,
                    "clip_high": 0.28},
           "train": {"lr": 3e-4, "group_size": 2, "env_groups": 2, "temperature": 1.0, "steps": 4},
           "env": {"name": "math", "max_new_tokens": 40}, "val": {"temperature": val_temperature}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": 0, "val-env/math/success": 0.9}]
    for step, success in zip(range(1, 5), (0.5, 0.45, 0.3, 0.3), strict=True):
        rows.append({"step": step, "actor/entropy": 0.2 * step, "actor/ppo_kl": 0.001 * step,
                     "actor/kl_loss": 5.0 if step == 1 else 0.0, "actor/grad_norm": 1.0, "actor/pg_clipfrac": 0.01,
                     "reward/correctness/mean": success, "train/math/success": success})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = [{"step": step, "traj": t, "group": t // 2, "prompt": 100 + t // 2, "total": float(t), "correct": t == 1,
                "reward": {}, "weighted": {}, "response_tokens": 10, "response_chars": 30}
               for step in range(1, 5) for t in (3, 0, 1, 2)]  # file order is not trajectory order
    (path / "rewards.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rewards))
    return path


def test_each_tool_gets_our_signals_under_its_own_names(doctors, tmp_path):
    data = doctors.convert(write_run(tmp_path / "run"))

    watch = data["rlwatch"]
    assert [step for step, _ in watch] == [1, 2, 3, 4]
    step1 = watch[0][1]
    assert step1["kl_divergence"] == pytest.approx(0.001)  # the PPO KL: the reference KL is no series here
    assert step1["entropy"] == pytest.approx(0.2) and step1["grad_norm"] == 1.0
    assert step1["reward_mean"] == pytest.approx(1.5) and step1["reward_std"] == pytest.approx(1.118, abs=1e-3)
    assert sorted(step1["rewards"]) == [0.0, 1.0, 2.0, 3.0]

    probe = data["rlprobe"]["steps"][0]
    assert probe["entropy_mean"] == pytest.approx(0.2) and probe["kl_mean"] == pytest.approx(0.001)
    assert probe["reward_max"] == 3.0 and probe["reward_components"] == {"correctness": 0.5}
    assert data["rlprobe"]["manifest"]["algorithm"] == "grpo"

    doctor = data["rldoctor"]
    assert doctor["records"][0] == {"step": 0, "val/test_score": 0.9}  # the validation before training, alone
    assert doctor["records"][1]["actor/ppo_kl"] == pytest.approx(0.001)
    assert doctor["records"][1]["rewards/correctness/mean"] == 0.5
    assert "actor/kl_loss" not in doctor["records"][1]
    assert doctor["config"]["group_size"] == 2 and doctor["config"]["max_response_length"] == 40

    audit = data["rlvr_audit"]
    assert audit["G"] == 2
    step, prompts = audit["steps"][0]
    assert step == 1
    assert prompts == [{"prompt_id": "step1-prompt100", "rewards": [0.0, 1.0]},
                       {"prompt_id": "step1-prompt101", "rewards": [0.0, 0.0]}]


def test_a_run_with_a_kl_term_feeds_the_reference_kl(doctors, tmp_path):
    data = doctors.convert(write_run(tmp_path / "run", kl_coef=0.1))
    assert data["rlwatch"][0][1]["kl_divergence"] == 5.0
    assert data["rlprobe"]["steps"][1]["kl_mean"] == 0.0
    assert data["rldoctor"]["records"][1]["actor/kl_loss"] == 5.0


def test_success_falls_from_the_start_at_the_training_temperature(doctors, tmp_path):
    # validation at another temperature: the start is training success at step 1 (0.5); below 0.4 from step 3
    assert doctors.fell(write_run(tmp_path / "a")) == 3
    # validation at the training temperature: the start is the step-0 validation (0.9); below 0.8 from step 2
    assert doctors.fell(write_run(tmp_path / "b", val_temperature=1.0)) == 2
