"""False alarms of the health monitor on healthy runs: a preset over several seeds, and what fired above `record`.

    python bench/false_alarms.py run --preset sokoban-tiny --seeds 0-9 [--parallel 2] [--out runs/false_alarms]
                                     [key=value ...]
    python bench/false_alarms.py table [--out runs/false_alarms] [--now]

`run` trains the preset as shipped once per seed, each as its own `rldyn train` process into OUT/<preset>/seed<s>
(one torch thread each; `--parallel 2` fits this 2-core CPU), skipping a run whose last step is done. `table` reads
the run directories alone and prints, per run: validation success at the start and the end with their standard
errors (clustered by problem, `val-env/<env>/success_se`), its change in standard errors of the difference, every
health event above `record` (rule, step, action; a cleared warning says when it cleared), and a last line with the
count of runs that had one. A healthy preset should have none. `--now` judges the logged signals with the rules as
they are in this checkout (`rldyn doctor`'s replay, `integrations/doctor.py`) instead of the events the run wrote.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rldynamics import metric_names as names
from rldynamics.integrations.doctor import diagnose, read_logs
from rldynamics.tracking.run_dir import read_events, read_metrics

ABOVE_RECORD = ("warn", "skip", "rollback", "stop")
CLEAR = "clear"


def seeds_of(text: str) -> list[int]:
    """`0-9` or `0,3,5` -> the seeds."""
    if "-" in text:
        first, last = map(int, text.split("-"))
        return list(range(first, last + 1))
    return [int(s) for s in text.split(",")]


def run_one(preset: str, seed: int, out: Path, steps: int | None, extra: list[str] = ()) -> Path:
    """Train `preset` with `seed` into OUT/<preset>/seed<seed> (skipped when its last step is done)."""
    run = out / preset / f"seed{seed}"
    if run.is_dir() and _done(run):
        return run
    keys = [f"seed={seed}", "model.threads=1", "log.report=false", f"log.run_dir={run.parent}",
            f"log.name={run.name}", *([f"train.steps={steps}"] if steps else []), *extra]
    if run.is_dir():
        keys.append("checkpoint.resume=latest")
    with open(out / f"{preset}-seed{seed}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "rldynamics.cli", "train", "--preset", preset, *keys],
                       stdout=log, stderr=subprocess.STDOUT, check=False)
    return run


def run_grid(out: Path, scenarios: str, arms: str, seeds: str, parallel: int, one) -> None:
    """`one(scenario, arm, seed)` for every combination of the comma lists (seeds as `seeds_of`), `parallel` at a
    time, each arm's runs under OUT/<scenario>-<arm>."""
    jobs = [(sc, arm, seed) for sc in scenarios.split(",") for arm in arms.split(",") for seed in seeds_of(seeds)]
    for sc, arm, _ in jobs:
        (out / f"{sc}-{arm}").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda job: one(*job), jobs))


def _done(run: Path) -> bool:
    try:
        rows = read_metrics(run)
    except FileNotFoundError:
        return False
    import yaml

    steps = yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"]
    stopped = bool(rows) and any(names.early_stop_reason(k) is not None for k in rows[-1])  # resuming would go on
    return stopped or any(r.get("step") == steps and names.STEP_TIME in r for r in rows)


def validation(run: Path) -> list[tuple[int, float, float]]:
    """(step, success, clustered standard error) of every validation of the run."""
    rows = read_metrics(run)
    out = []
    for r in rows:
        env = next((e for k in r if (e := names.val_success_env(k)) is not None), None)
        if env is not None:
            se = r.get(names.env_metric(env, names.SUCCESS_SE, validation=True), math.nan)
            out.append((r["step"], float(r[names.val_success(env)]), float(se)))
    return out


def alarms(run: Path, now: bool = False) -> list[str]:
    """`rule@step (action)` for every event above record (`now`: of the rules of this checkout over the logged
    signals); a warning that cleared says where."""
    events = diagnose(read_logs(run)).events if now else read_events(run)
    cleared = {(e["rule"]): e["step"] for e in events if e.get("action") == CLEAR}
    return [f"{e['rule']}@{e['step']} ({e['action']}"
            + (f", cleared at {cleared[e['rule']]})" if e["rule"] in cleared and e["action"] == "warn" else ")")
            for e in events if e.get("action") in ABOVE_RECORD]


def table(out: Path, now: bool = False) -> str:
    """The markdown table of every run under OUT, and the count of runs with an alarm above record."""
    lines = ["| run | validation start -> end (± SE) | change / SE | alarms above record |", "|---|---|---:|---|"]
    runs = sorted(p.parent for p in out.glob("*/seed*/metrics.jsonl"))
    flagged = 0
    for run in runs:
        val, found = validation(run), alarms(run, now)
        flagged += bool(found)
        if len(val) >= 2:
            (_, a, sa), (_, b, sb) = val[0], val[-1]
            se = math.hypot(sa, sb)
            cells = f"{a:.1%} ± {sa:.1%} -> {b:.1%} ± {sb:.1%}", f"{(b - a) / se:+.1f}" if se > 0 else "-"
        else:
            cells = "-", "-"
        lines.append(f"| {run.parent.name}/{run.name} | {cells[0]} | {cells[1]} | {'; '.join(found) or 'none'} |")
    lines.append(f"\n{flagged} of {len(runs)} runs had an alarm above record.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("run", "table"))
    parser.add_argument("--preset", default="sokoban-tiny")
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: the preset's)")
    parser.add_argument("--out", type=Path, default=Path("runs/false_alarms"))
    parser.add_argument("--now", action="store_true", help="the rules of this checkout over the logged signals")
    parser.add_argument("overrides", nargs="*", help="key=value for every run (run only)")
    args = parser.parse_args(argv)
    if args.what == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda s: run_one(args.preset, s, args.out, args.steps, args.overrides),
                          seeds_of(args.seeds)))
    print(table(args.out, args.now))
    return 0


if __name__ == "__main__":
    sys.exit(main())
