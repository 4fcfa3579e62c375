"""Training over two ranks (torchrun, gloo, FSDP2) against one process: same batches, metrics and weights;
checkpoints that resume exactly on the same number of ranks and work on another; the launcher's errors.

The runs are small (tiny 1-layer model, 2 groups x 3 one-turn math replies, 3 steps) but exercise every part:
sharded rollouts and validation, the critic (GAE whitening over the global batch), the KL reference, the gradient
analysis with reward components, the collapse diagnostics (their cross-scoring rows split over the ranks), per-step
checkpoints, the mismatch metrics (`algo.tis_cap`) from the update's own log-probs at step 2, where no analysis
asks for the old-log-prob pass. `train.row_seeded_sampling=true` makes the batches
independent of how rows are split over ranks. `train.shared_prefix=false`: an FSDP2-sharded update forwards whole
rows (`analysis.objective.actor_terms`), so the one-process run does too, and both compute the same sums.

Tolerance (stated in docs/multi-device.md): the rollouts are identical; the rest differs by float rounding
of sums taken in another order (gradients summed over ranks, micro-batches of other rows): after 3 steps every
metric agrees within 1e-3 relative or 1e-6 absolute (loss values near 0), the weights within 1e-6 in relative L2
norm and 1e-5 per entry (measured: 2e-8 and 1.7e-7 for the actor, 1.2e-7 and 5e-7 for the critic). A batch whose
rewards are all equal is not a fair test: GAE whitening then divides float noise by a near-zero spread, and
Adam's normalisation turns noise-level gradients into full-size steps, in one process as well (another
micro-batch size moves such a run as much as another number of ranks).
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, run_ranks
from rldynamics import metric_names as names
from rldynamics.config import make_config
from rldynamics.threads import usable_cores
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train

pytestmark = pytest.mark.slow  # every test here starts torchrun processes

LR = 3e-4
PRESET = "math-tiny"  # one-turn arithmetic replies: the length component varies, so the rewards do from step 1
RUN = [*FAST, "train.steps=3", "train.group_size=3", "train.mini_batch_size=64", "train.micro_batch_size=2",
       "train.ppo_epochs=1", f"train.lr={LR}", "train.row_seeded_sampling=true", "train.shared_prefix=false",
       "tiny.layers=1",
       "tiny.hidden_size=32", "env.max_turns=1", "env.max_new_tokens=10", "env.math.length_target=20",
       "val.env_groups=2", "val.every=3", "val.before_train=false", "algo.adv_estimator=gae", "algo.kl_coef=0.01",
       "algo.entropy_coef=0.001", "algo.tis_cap=2.0", "analysis.enabled=true", "analysis.every=2",
       "analysis.reward_grad=true", "analysis.num_buckets=2", "checkpoint.every=1", "log.samples_per_step=100",
       "collapse.enabled=true", "collapse.compute_freq=1", "collapse.bootstrap_resamples=20"]


def _weights(run, step: int) -> dict[str, torch.Tensor]:
    ckpt = run / "checkpoints" / f"step_{step}"
    return {f"{part}/{k}": v for part in ("actor", "critic") for k, v in
            load_file(str(ckpt / part / "model.safetensors")).items()}


def _rows(run) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("timing_s/")} for row in read_metrics(run)]


def _texts(run) -> list[str]:
    return [json.loads(line)["text"] for line in (run / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run on two ranks (FSDP2, launched with torchrun) and in one process."""
    root = tmp_path_factory.mktemp("dist")
    cache = str(root / "cache")
    common = [*RUN, f"log.run_dir={root}"]
    mp = pytest.MonkeyPatch()
    mp.setenv("RLDYN_CACHE", cache)
    one = train(make_config(PRESET, overrides=[*common, "log.name=one"]))  # builds the cached tiny model first
    run_ranks(["-m", "rldynamics.cli", "train", "--preset", PRESET, *common, "log.name=two"], timeout=300,
              env={"RLDYN_CACHE": cache})
    yield root, one, root / "two"
    mp.undo()


def test_two_ranks_give_the_one_process_run(runs):
    _, one, two = runs
    assert _texts(two) == _texts(one) and len(_texts(one)) == 3 * 2 * 3  # every trajectory of every step
    a, b = _rows(one), _rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert a[0].keys() == b[0].keys() and "grad_norm/all/task" in a[0] and "critic/vf_loss" in a[0]
    assert "reward_grad/all/cos_total/length" in a[0] and "val-env/math/success" in a[2]
    assert "collapse_first_turn_sample/mi_estimate" in a[0] and "collapse_trajectory_sample/mi_estimate" in a[0]
    assert a[0]["critic/score/max"] > a[0]["critic/score/min"]  # rewards that vary: a fair test (module docstring)
    assert "grad_norm/all/task" not in a[1] and "rollout/corr/k3_kl" in a[1]
    # step 2: the mismatch metrics from the update's own log-probs, summed over the ranks, with no old-log-prob pass
    assert [names.timing("old_log_prob") in row for row in read_metrics(two)] == [True, False, True]
    for x, y in zip(a, b, strict=True):
        for key, value in x.items():
            # a collapse z-score divides an MI near 0 (equal to 1e-6 here) by a marginal std of a few hundredths, so
            # its rounding difference is that much larger
            tol = 1e-4 if "zscore" in key else 1e-6
            assert y[key] == pytest.approx(value, rel=1e-3, abs=tol, nan_ok=True), (x["step"], key)
    wa, wb = _weights(one, 3), _weights(two, 3)
    assert wa.keys() == wb.keys()
    diff = math.sqrt(sum(float((wa[k] - wb[k]).double().square().sum()) for k in wa))
    size = math.sqrt(sum(float(wa[k].double().square().sum()) for k in wa))
    assert diff / size < 1e-6
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    assert any(not torch.equal(wa[k], _weights(one, 1)[k]) for k in wa)  # it trained


def test_checkpoints_resume_exactly_on_two_ranks_and_on_one(runs, tmp_path, monkeypatch):
    """A two-rank checkpoint is an ordinary one (HF weights, one-process optimizer format): resumed on two ranks
    it continues bit for bit; resumed in one process it continues within the stated tolerance (module docstring)."""
    root, _, two = runs
    monkeypatch.setenv("RLDYN_CACHE", str(root / "cache"))
    final = _weights(two, 3)
    again, single = tmp_path / "again", tmp_path / "single"
    for copy in (again, single):
        shutil.copytree(two, copy)
        shutil.rmtree(copy / "checkpoints" / "step_3")
    run_ranks(["-m", "rldynamics.cli", "train", "--preset", PRESET, *RUN, f"log.run_dir={tmp_path}",
               f"checkpoint.resume={again / 'checkpoints' / 'step_2'}"], timeout=300,
              env={"RLDYN_CACHE": str(root / "cache")})
    resumed = _weights(again, 3)
    assert all(torch.equal(resumed[k], final[k]) for k in final)  # same number of ranks: exact
    # the record names its run's directory ("again", "two"): its size may differ by the header's 8-byte padding
    same = [{k: v for k, v in rows[-1].items() if k != names.RECORD_BYTES} for rows in (_rows(again), _rows(two))]
    assert same[0] == pytest.approx(same[1], nan_ok=True)
    train(make_config(PRESET, overrides=[*RUN, f"log.run_dir={tmp_path}",
                                 f"checkpoint.resume={single / 'checkpoints' / 'step_2'}"]))
    other = _weights(single, 3)
    assert max(float((other[k] - final[k]).abs().max()) for k in final) < 1e-5


def test_launcher_and_ranks_report_errors_once_and_end(tmp_path):
    """`rldyn train --nproc 2`: a setting two ranks cannot honour is refused by the launcher before any rank
    starts; an error found by rank 0 once the ranks run (a run directory that already holds a run) is raised on
    every rank, printed once, and ends the job with exit code 2 (no hang) and nothing else on stderr: torchrun's
    own report of the failed ranks (a traceback and a table) is not printed after the line."""
    import subprocess
    import sys

    def launch(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rldynamics.cli", "train", "--nproc", "2", *overrides,
                               f"log.run_dir={tmp_path}"], capture_output=True, text=True, timeout=180,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    def errors(done: subprocess.CompletedProcess) -> list[str]:
        return [line for line in done.stderr.splitlines() if line.startswith("rldyn train:")]

    bad = launch("train.env_groups=1")
    assert bad.returncode == 2 and errors(bad) == [
        "rldyn train: config error: train.env_groups=1 is fewer groups than the 2 ranks (each rank rolls out "
        "whole groups); set train.env_groups >= 2 or use fewer ranks"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.jsonl").write_text('{"step": 0}\n')
    taken = launch("log.name=taken")
    assert taken.returncode == 2 and len(errors(taken)) == 1 and "already holds a run" in errors(taken)[0]
    assert taken.stderr.strip().splitlines() == errors(taken), taken.stderr


CLOSE_WORKER = """import os
from rldynamics import dist
dist.init_from_env()
import rldynamics.train.trainer  # noqa: E402,F401  (what `rldyn train` imports once the group exists)
dist.close()
os.write(1, f"threads after close: {len(os.listdir('/proc/self/task'))}\\n".encode())  # one write: no interleaving
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_closing_the_group_ends_its_threads(tmp_path):
    """`dist.close()` really ends the process group: no gloo thread is left to run into interpreter shutdown, where
    a rank exiting right after a collective (an error raised on every rank) would abort instead of exiting with
    its code."""
    script = tmp_path / "close.py"
    script.write_text(CLOSE_WORKER)
    out = run_ranks([str(script)], timeout=300)
    assert out.count("threads after close: 1") == 2, out


@pytest.mark.skipif(usable_cores() < 2, reason="--nproc auto starts two ranks on 2 usable cores or more")
def test_nproc_auto_trains_on_two_replicas_and_a_replay_runs_on_them_again(tmp_path, tiny_cache):
    """`rldyn train` with no thread count chosen: two ranks (replicas, the line saying so first); `rldyn replay` of a
    recorded step starts two ranks again, rolls the run forward on them and ends with the run's weights bit for bit;
    `--attribute` (one process) is then served from the kept roll-forward, and without one it is refused, saying what
    to run first."""
    import subprocess
    import sys

    from rldynamics.sweep.launch import THREAD_VARS

    env = {**{k: v for k, v in os.environ.items() if k not in THREAD_VARS}, "RLDYN_CACHE": tiny_cache}

    def rldyn(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rldynamics.cli", *args], capture_output=True, text=True,
                              timeout=300, env=env)

    done = rldyn("train", *FAST, "val.every=0", "record.every=1", f"log.run_dir={tmp_path}", "log.name=auto")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[0].startswith("2 ranks of "), done.stdout[:500]
    run = tmp_path / "auto"
    assert "shard: false" in (run / "config.yaml").read_text()
    refused = rldyn("replay", str(run), "--step", "2", "--attribute")
    assert refused.returncode == 2 and "was trained on 2 ranks" in refused.stderr, refused.stderr[-2000:]
    replayed = rldyn("replay", str(run), "--step", "2")
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    assert "(2 ranks of " in replayed.stdout
    summary = json.loads((run / "replays" / "step_2" / "replay.json").read_text())
    assert summary["weights_identical"] is True and summary["ranks"] == {"recorded": 2, "replayed": 2}
    attributed = rldyn("replay", str(run), "--step", "2", "--attribute")
    assert attributed.returncode == 0, attributed.stderr[-2000:]
    summary = json.loads((run / "replays" / "step_2" / "replay.json").read_text())
    norm = summary["metrics"][names.ACTOR_GRAD_NORM]  # the same start, sums in another order
    assert summary["weights_identical"] is None and norm["replayed"] == pytest.approx(norm["recorded"], rel=1e-4)
    assert "not compared (the run trained the step on 2 ranks" in attributed.stdout
