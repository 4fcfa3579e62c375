"""Fault drill: kill `rldyn train` at every write boundary of every step, resume each time, and damage checkpoint
files at random; count what was survived. The larger form of tests/test_crash.py and tests/test_checkpoint.py.

    python scripts/fault_drill.py OUT_DIR [--steps 3] [--damages 200] [--seed 0]

Kills: a chain of processes, each SIGKILLed by the `RLDYN_CRASH_AT` hook at the next (point, step), each resuming
the last (`checkpoint.resume=latest`); then one process completes the run. Passes when the run directory then
equals an uninterrupted run's (every row, sample and analysis file once, weights bit-identical).
Damages: a copy of the last checkpoint gets one random damage (truncation, bit flip, emptied, deleted, garbage
appended, bytes replaced) in one random file; resuming and probing it must each raise one CheckpointError line
naming a file of the checkpoint (a damage that changes nothing may also resume cleanly), never anything else.
Exit status 0 when everything passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

SETTINGS = ["train.env_groups=2", "train.group_size=2", "train.mini_batch_size=2", "train.micro_batch_size=1",
            "val.env_groups=3", "val.every=2", "env.max_turns=2", "env.max_new_tokens=8",
            "model.warm_start_episodes=8", "model.warm_start_epochs=1", "log.progress=false",
            "log.samples_per_step=2", "log.report=false", "checkpoint.every=1", "algo.adv_estimator=gae",
            "analysis.enabled=true", "analysis.every=2"]
POINTS = ["samples", "analysis", "logged", "checkpoint_files", "checkpoint_manifest"]
DAMAGES = ["truncate", "flip", "empty", "delete", "append", "replace"]


def rldyn_train(args: list[str], crash_at: str | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "RLDYN_CRASH_AT"}
    if crash_at:
        env["RLDYN_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "rldynamics.cli", "train", *args], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def content(run: Path) -> dict[str, object]:
    """What must match between runs: rows without timings, samples, reward rows, analysis files, final weights."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    files = {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "analysis").rglob("*")) if p.is_file()}
    last = max((p for p in (run / "checkpoints").glob("step_*")), key=lambda p: int(p.name[5:]))
    weights = {str(p.relative_to(last)): p.read_bytes() for p in sorted(last.rglob("*.safetensors"))}
    return {"rows": [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in rows],
            "samples": (run / "samples.jsonl").read_text(), "rewards": (run / "rewards.jsonl").read_text(),
            "analysis": files, "weights": weights,
            "checkpoints": sorted(p.name for p in (run / "checkpoints").iterdir())}


def kill_drill(out: Path, steps: int) -> tuple[int, bool]:
    common = [*SETTINGS, f"train.steps={steps}", f"log.run_dir={out}"]
    assert rldyn_train([*common, "log.name=straight"]) == 0
    kills = [(p, s) for s in range(1, steps + 1) for p in POINTS if p != "analysis" or (s - 1) % 2 == 0]
    survived = 0
    for n, (point, step) in enumerate(kills):
        rc = rldyn_train([*common, "log.name=killed", *(["checkpoint.resume=latest"] if n else [])],
                         crash_at=f"{point}:{step}")
        print(f"kill {n + 1}/{len(kills)} at {point}:{step}: exit {rc}", flush=True)
        survived += rc == -signal.SIGKILL
    assert rldyn_train([f"log.run_dir={out}", "log.name=killed", "checkpoint.resume=latest"]) == 0
    same = content(out / "killed") == content(out / "straight")
    leftovers = [p.name for p in (out / "killed" / "checkpoints").iterdir() if p.name.startswith(".")]
    print(f"kills: {survived} of {len(kills)} processes killed and resumed; final run identical to the "
          f"uninterrupted one: {same}; temporary directories left: {leftovers}")
    return survived, same and not leftovers and survived == len(kills)


def damage(ckpt: Path, rng: random.Random) -> str:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    target, kind = rng.choice(files), rng.choice(DAMAGES)
    data = bytearray(target.read_bytes())
    if kind == "truncate":
        data = data[: rng.randrange(len(data))] if data else data
    elif kind == "flip" and data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "empty":
        data = bytearray()
    elif kind == "append":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == "replace" and data:
        i = rng.randrange(len(data))
        data[i:i + 16] = bytes(rng.randrange(256) for _ in data[i:i + 16])
    if kind == "delete":
        target.unlink()
    else:
        target.write_bytes(bytes(data))
    return f"{kind} {target.relative_to(ckpt)}"


def attempts(run: Path, last: Path, probe_name: str) -> list[tuple[str, object]]:
    """Resuming the damaged run, and probing its damaged checkpoint, as callables."""
    from rldynamics.config import make_config
    from rldynamics.train.probe import probe_checkpoint
    from rldynamics.train.trainer import train

    overrides = [*SETTINGS, f"log.run_dir={run.parent}", f"log.name={run.name}", "checkpoint.resume=latest",
                 f"train.steps={int(last.name[5:])}"]
    return [("resume", lambda: train(make_config(overrides=overrides))),
            ("probe", lambda: probe_checkpoint(last, [f"log.run_dir={run.parent}", f"log.name={probe_name}"]))]


def damage_drill(out: Path, count: int, seed: int) -> tuple[int, bool]:
    from rldynamics.train.checkpoint import CheckpointError

    source, rng, ok, tried = out / "killed", random.Random(seed), True, 0
    for i in range(count):
        run = out / f"damaged_{i}"
        shutil.copytree(source, run)
        last = max(run.glob("checkpoints/step_*"), key=lambda p: int(p.name[5:]))
        what = damage(last, rng)
        for name, attempt in attempts(run, last, f"probe_{i}"):
            tried += 1
            try:
                attempt()
                print(f"damage {i} ({what}): {name} went ahead (the damage changed nothing it uses)")
            except CheckpointError as e:
                good = "\n" not in str(e) and str(last) in str(e)
                ok &= good
                if not good:
                    print(f"damage {i} ({what}): {name}: BAD MESSAGE {e}")
            except Exception as e:  # noqa: BLE001 (the drill reports anything else as a failure)
                ok = False
                print(f"damage {i} ({what}): {name}: {e.__class__.__name__}: {e}")
        shutil.rmtree(run)
        shutil.rmtree(out / f"probe_{i}", ignore_errors=True)
    print(f"damages: {count} damaged checkpoints, {tried} resume/probe attempts, all answered by one line "
          f"naming the file: {ok}")
    return tried, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--damages", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=False)
    _, kills_ok = kill_drill(args.out.resolve(), args.steps)
    _, damages_ok = damage_drill(args.out.resolve(), args.damages, args.seed)
    return 0 if kills_ok and damages_ok else 1


if __name__ == "__main__":
    sys.exit(main())
