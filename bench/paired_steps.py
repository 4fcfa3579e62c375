"""Seconds per training step of this checkout against another one, paired: the two alternate in one run.

    python bench/paired_steps.py --baseline-src DIR [--rounds 2] [--steps 3] [--preset math-smollm2] [key=value ...]
    python bench/paired_steps.py --baseline-src DIR --replay runs/<name> --step N [--rounds 2] [--steps 6]
    python bench/paired_steps.py --baseline-set train.micro_batch_size=8 [--rounds 2] [key=value ...]
    python bench/paired_steps.py --baseline-env THP_MEM_ALLOC_ENABLE=1 [--replay RUN --step N] [key=value ...]
    python bench/paired_steps.py --baseline-src DIR --nproc 2 [--rounds 2] [key=value ...]

`DIR` is another checkout's `src/` (a `git worktree` of an earlier commit). Each round runs `rldyn train` from the
baseline and then from this checkout, in fresh processes, `--steps` steps each on the same preset and overrides
(validation, checkpoints and the report off); the first step of a process (one-off costs: loading, the first
compile of kernels) is dropped. Printed: the median seconds of the step and of each phase (`timing_s/*`) per side,
and baseline / ours. Both sides see the same machine at nearly the same time, so the ratio holds under a load
that the absolute seconds do not; name the CPU and the load next to any figure. Fresh runs sample their own
tokens (each side's weights drift apart after the first update, and so do the reply lengths), so their ratio
carries the noise of the work itself.

`--baseline-set KEY=VALUE` (repeatable) adds overrides to the baseline's runs alone: two settings of one checkout
compared the same way (`--baseline-src` defaults to this checkout's `src/`). `--baseline-env KEY=VALUE` (repeatable)
sets an environment variable in the baseline's processes alone, for settings read at a process's start (malloc,
torch's or oneDNN's environment), in training runs and in replays alike.

`--nproc N` trains this checkout's side on N ranks (`rldyn train --nproc N`: replicas on gloo unless the overrides set
`model.shard`), the baseline's in one process: what the ranks buy on this machine's cores, which one process
leaves idle. Each rank's step is timed; the ranks wait for each other, so rank 0's timings are the step's.

`--replay RUN --step N` times the update alone on identical work: each round replays the recorded step N of a run
(what `rldyn replay` runs: the same rollout, the same starting weights) `--steps` times in one process from the
baseline and then from this checkout, drops each process's first replay (its one-off costs, as a run's first
step), and reads the replays' `timing_s/update_actor` (and their other phases). The run needs its records to keep
the state before their step (`record.state_before_mb` above the model's size) or a checkpoint before N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rldynamics.threads import default_threads, usable_cores

OURS = Path(__file__).resolve().parents[1] / "src"
QUIET = ["val.every=0", "val.before_train=false", "checkpoint.save_last=false", "log.progress=false",
         "log.report=false", "record.every=0"]


def one_process_env() -> dict[str, str]:
    """The environment with the default thread count exported: `rldyn train` then runs in one process (its
    `--nproc auto` takes two ranks only where no thread count is chosen), as in checkouts older than that rule."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(default_threads(usable_cores()))}


def side_env(src: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one side's processes: `one_process_env`, the checkout `src` on the path, then `extra`."""
    return {**one_process_env(), "PYTHONPATH": str(src), **(extra or {})}


def parse_env(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings as a dict (the value may hold `=`); ValueError naming the first malformed one."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or any(c.isspace() for c in key):
            raise ValueError(f"--baseline-env {item!r}: expected KEY=VALUE, e.g. THP_MEM_ALLOC_ENABLE=1")
        out[key] = value
    return out


def rldyn(src: Path, *args: str, env: dict[str, str] | None = None) -> None:
    """`rldyn ARGS` from the checkout whose `src/` is `src`, in a fresh process of its own (its output dropped), with
    `env` added to its environment; with `--nproc N` among ARGS it starts the N ranks itself."""
    cmd = [sys.executable, "-c", "import sys; from rldynamics.cli import main; sys.exit(main())", *args]
    subprocess.run(cmd, env=side_env(src, env), check=True, stdout=subprocess.DEVNULL)


def timings(row: dict) -> dict[str, float]:
    return {k.removeprefix("timing_s/"): v for k, v in row.items() if k.startswith("timing_s/")}


def run_steps(src: Path, preset: str, steps: int, overrides: list[str], nproc: int = 1,
              env: dict[str, str] | None = None) -> list[dict[str, float]]:
    """The `timing_s/*` values of each step after the first of one `rldyn train` run from `src` (on `nproc` ranks:
    replicas unless `overrides` set `model.shard`; `env` added to its environment)."""
    ranks = [] if nproc == 1 else ["--nproc", str(nproc)]
    if nproc > 1 and not any(o.startswith("model.shard=") for o in overrides):
        overrides = ["model.shard=false", *overrides]
    with tempfile.TemporaryDirectory() as tmp:
        rldyn(src, "train", *ranks, "--preset", preset, f"train.steps={steps}", *QUIET, f"log.run_dir={tmp}",
              *overrides, env=env)
        metrics = next(Path(tmp).glob("*/metrics.jsonl"))  # log.run_dir/<the run's name>/
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [timings(r) for r in rows[1:]]


REPLAYS = """
import json, sys, tempfile
from pathlib import Path
from rldynamics.config import load_config
from rldynamics.tracking.step_records import RecordedStep
from rldynamics.train import replay
run, step, times = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
record = RecordedStep.read(replay.record_path(run, step))
cfg = load_config(run / "config.yaml")
start = replay.start_checkpoint(run, cfg, step, record)
for _ in range(times):
    with tempfile.TemporaryDirectory() as tmp:
        done = replay.run_replay(replay.replay_config(cfg, start, step, record, []), Path(tmp) / "replay", record,
                                 attribute=False)
    print("ROW", json.dumps(done.metrics), flush=True)
"""


def replay_steps(src: Path, run: Path, step: int, times: int,
                 env: dict[str, str] | None = None) -> list[dict[str, float]]:
    """The `timing_s/*` values of the recorded step `step` of `run` replayed `times` times in one process from
    `src` (each replay opens the session at the step's start again, as `rldyn replay` does; `env` added to its
    environment), the first dropped."""
    cmd = [sys.executable, "-c", REPLAYS, str(run), str(step), str(times)]
    out = subprocess.run(cmd, env=side_env(src, env), check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line.removeprefix("ROW ")) for line in out.splitlines() if line.startswith("ROW ")]
    return [timings(r) for r in rows[1:]]


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", type=Path, default=OURS)
    parser.add_argument("--baseline-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the baseline's runs alone (repeatable)")
    parser.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable of the baseline's processes alone (repeatable)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--preset", default="math-smollm2")
    parser.add_argument("--replay", type=Path, help="a run directory with a record of --step")
    parser.add_argument("--step", type=int)
    parser.add_argument("--nproc", type=int, default=1, help="ranks of this checkout's runs (the baseline's: 1)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.replay is not None and args.step is None:
        parser.error("--replay needs --step N (a step with a record in RUN/records/)")
    if args.steps < 2:
        parser.error("--steps must be 2 or more: the first step (or replay) of each process is dropped")
    if args.replay is not None and args.baseline_set:
        parser.error("--baseline-set applies to training runs; a replay runs the recorded step's own config")
    if args.replay is not None and args.nproc != 1:
        parser.error("--nproc applies to training runs; a replay runs on the ranks its record names")
    if args.baseline_src == OURS and not (args.baseline_set or args.baseline_env):
        parser.error("give --baseline-src DIR (another checkout's src/), --baseline-set KEY=VALUE or --baseline-env "
                     "KEY=VALUE")
    try:
        baseline_env = parse_env(args.baseline_env)
    except ValueError as e:
        parser.error(str(e))
    got: dict[str, list[dict[str, float]]] = {"baseline": [], "ours": []}
    for round_ in range(args.rounds):
        for side, src, extra, nproc, env in (("baseline", args.baseline_src, args.baseline_set, 1, baseline_env),
                                             ("ours", OURS, [], args.nproc, {})):
            rows = (replay_steps(src, args.replay, args.step, args.steps, env) if args.replay else
                    run_steps(src, args.preset, args.steps, [*args.overrides, *extra], nproc, env))
            got[side] += rows
            shown = "update_actor" if args.replay else "step"
            print(f"round {round_ + 1} {side}: " + ", ".join(f"{r[shown]:.2f}" for r in rows) + f" s ({shown})",
                  flush=True)
    base, ours = medians(got["baseline"]), medians(got["ours"])
    what = f"replay of {args.replay} step {args.step}" if args.replay else f"{args.preset} {' '.join(args.overrides)}"
    what += f" (baseline also {' '.join(args.baseline_set)})" if args.baseline_set else ""
    what += f" (baseline's environment also {' '.join(args.baseline_env)})" if args.baseline_env else ""
    what += f" (ours on {args.nproc} ranks)" if args.nproc > 1 else ""
    print(f"\n{what}: {len(got['ours'])} steps a side")
    print("| phase | baseline s | ours s | baseline / ours |\n|---|---:|---:|---:|")
    for phase in sorted(set(base) | set(ours), key=lambda p: (p not in ("step", "update_actor"), p)):
        b, o = base.get(phase, 0.0), ours.get(phase, 0.0)
        if max(b, o) >= 0.05:
            print(f"| {phase} | {b:.2f} | {o:.2f} | {b / o if o else float('inf'):.2f} |")


if __name__ == "__main__":
    main()
