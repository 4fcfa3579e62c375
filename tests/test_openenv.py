"""The OpenEnv client (`env.name=openenv`) against a guess-the-number server on 127.0.0.1
(tests/openenv_guess_server.py, started once per module in a subprocess that ends itself after
four minutes and is killed when the module is done): episodes over sessions, seeds, action words and
free-form answers, actions the server rejects, a full server, unreachable servers, a few training
steps. The tests run against the minimal server of OpenEnv's protocol, and against openenv-core's
own server where an interpreter with openenv-core is at hand (this one, or RLDYN_OPENENV_PYTHON)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import require_package
from rldynamics.cli import main
from rldynamics.config import ConfigError, make_config
from rldynamics.envs.openenv import OpenEnvEnv, ws_url
from rldynamics.tracking.run_dir import read_rewards

require_package("websockets", 'pip install -e ".[test]"')

SERVER = Path(__file__).with_name("openenv_guess_server.py")
MAX_SESSIONS = 8


def openenv_python() -> str | None:
    """An interpreter with openenv-core: RLDYN_OPENENV_PYTHON, else this one if it has it."""
    named = os.environ.get("RLDYN_OPENENV_PYTHON")
    return named or (sys.executable if importlib.util.find_spec("openenv") else None)


@pytest.fixture(scope="module", params=["minimal", "openenv-core"])
def url(request, tmp_path_factory):
    """The URL of a running guess-the-number server of the parameter's kind."""
    python, args = sys.executable, []
    if request.param == "openenv-core":
        python, args = openenv_python(), ["--openenv"]
        if python is None:  # skipped where it is missing, failed under CI (the test extra has it)
            require_package("openenv", "pip install openenv-core==0.3.0, or "
                            "RLDYN_OPENENV_PYTHON=<a python that has it>")
    folder = tmp_path_factory.mktemp("openenv")
    port_file, log = folder / "port", open(folder / "server.log", "w")
    proc = subprocess.Popen([python, str(SERVER), str(port_file), *args, "--max-sessions",
                             str(MAX_SESSIONS), "--lifetime", "240"], stdout=log, stderr=log,
                            start_new_session=True)
    try:
        yield f"http://127.0.0.1:{wait_for_port(proc, port_file, folder / 'server.log')}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def wait_for_port(proc: subprocess.Popen, port_file: Path, log: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the test server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return port_file.read_text()


def number(seed: int, top: int = 4) -> int:
    """The server's number for `seed` (the game's own rule)."""
    return 1 + int(random.Random(seed).random() * top)


def test_an_episode_is_a_session_and_a_seed_its_game(url):
    env = OpenEnvEnv(url=url, observation_field="text", actions=["1", "2", "3", "4"])
    for seed in (5, 6, 5):
        assert env.reset(seed) == f"Game {seed}: guess my number from 1 to 4."
        wrong = next(a for a in env.actions if a != str(number(seed)))
        miss = env.step(wrong)
        hint = "higher" if int(wrong) < number(seed) else "lower"
        assert miss.observation == f"Wrong: {hint}." and miss.reward == {"reward": 0.0}
        assert not miss.done and not env.success()
        hit = env.step(str(number(seed)))
        assert hit.observation == f"Right, it is {number(seed)}." and hit.reward == {"reward": 1.0}
        assert hit.done and env.success() and env.metrics() == {"done": 1.0, "invalid_actions": 0.0}
        with pytest.raises(RuntimeError, match="episode is over"):
            env.step("1")


def test_free_form_answers_extra_fields_and_actions_the_server_rejects(url):
    env = OpenEnvEnv(url=url, reset_fields={"top": 2}, action_fields={"metadata": {"by": "test"}},
                     success_threshold=2.0)
    first = env.reset(9)
    assert json.loads(first) == {"guesses": 0, "text": "Game 9: guess my number from 1 to 2."}
    rejected = env.step("a guess longer than eight characters")  # the action model says no
    assert rejected.info["action_is_valid"] == 0 and rejected.observation == first
    assert not rejected.done
    miss = env.step(str(3 - number(9, 2)))
    assert json.loads(miss.observation)["guesses"] == 1
    hit = env.step(f" {number(9, 2)} ")
    assert hit.done and hit.reward == {"reward": 1.0}
    assert not env.success()  # the return, 1, is below the threshold, 2
    assert env.metrics() == {"done": 1.0, "invalid_actions": 1.0}
    strict = OpenEnvEnv(url=url, action_fields={"no_such_field": 1})
    strict.reset(1)
    assert strict.step("1").info["action_is_valid"] == 0
    strict.close()


def test_a_full_server_says_how_many_sessions_a_rollout_needs(url):
    envs = [OpenEnvEnv(url=url) for _ in range(MAX_SESSIONS + 1)]
    try:
        with pytest.raises(RuntimeError, match=r"is full \(8 of 8 sessions\).*max_concurrent_envs"):
            for env in envs:
                env.reset(0)
    finally:
        for env in envs:
            env.close()
    again = OpenEnvEnv(url=url)  # closed sessions are freed on the server
    assert "Game 0" in again.reset(0)
    again.close()


def test_addresses_and_unreachable_servers():
    assert ws_url("http://127.0.0.1:8000") == "ws://127.0.0.1:8000/ws"
    assert ws_url("https://host.example/env/") == "wss://host.example/env/ws"
    assert ws_url("ws://h:1/ws") == "ws://h:1/ws" and ws_url("h:1") == "ws://h:1/ws"
    with pytest.raises(ValueError, match="is not an http"):
        ws_url("ftp://h:1")
    with pytest.raises(ConfigError, match="set env.openenv.url"):
        make_config(overrides=["env.name=openenv"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # a port nobody listens on once the socket is closed
    env = OpenEnvEnv(url=f"http://127.0.0.1:{closed}", timeout=5)  # builds without connecting
    with pytest.raises(ConnectionError, match="cannot open a session with the OpenEnv server"):
        env.reset(0)


def test_trains_a_few_steps_through_the_client(url, fast_overrides, tmp_path):
    code = main(["train", *fast_overrides, "env.name=openenv", f"env.openenv.url={url}",
                 "env.openenv.actions=[1,2,3,4]", "env.openenv.observation_field=text",
                 "env.max_actions_per_turn=1", "env.max_turns=3", "log.name=o"])
    assert code == 0
    run = tmp_path / "runs" / "o"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    logged = {"reward/reward/mean", "train/openenv/done", "train/openenv/invalid_actions"}
    assert logged <= set(rows[1])
    assert "val-env/openenv/success" in rows[2]
    rewards = read_rewards(run)
    assert rewards and all(set(r["reward"]) == {"reward", "format_penalty"} for r in rewards)
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert "guess my number from 1 to 4" in sample["text"]
