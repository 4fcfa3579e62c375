"""Actions that save runs: a pathology scenario trained under several arms of the health monitor (no action, stop,
rollback, a stop with the state before the trouble, rollback with a remedy, RAGEN's filter), over seeds; the
validation success each arm ends with, with its standard error.

    python bench/rescue.py run [--scenarios lr100] [--arms none,stop,rollback,back_stop,remedy,filter] [--seeds 0-4]
        [--parallel 2]
    python bench/rescue.py table [--out runs/rescue]

Each (scenario, arm, seed) is one `rldyn train` process (one torch thread) into OUT/<scenario>-<arm>/seed<s>
(`false_alarms.run_one`: a finished run is skipped). The table gives, per scenario and arm, the mean of the runs'
last validation success with the standard error over seeds, the step they ended at, and their actions (stops,
rollbacks with their changes). A stopped run ends with the validation it had before the stop: the policy it leaves
behind is not validated again.

Scenarios (`SCENARIOS`): `lr100`, the default preset with a learning rate 100 x its own (3e-2): the first update
moves the policy far off (PPO KL above `health.drift_kl`: the `policy_drift` rule at step 1) and the replies break;
the remedy `train.lr*=0.01` goes back to the preset's learning rate. `entropy_bonus`, `math-tiny` with an entropy
bonus of 0.5: the entropy rises (the `entropy_surge` rule) and correctness falls; the remedy turns the bonus off.
`blowup_smollm2`, `math-smollm2` (SmolLM2-135M) at 100 x its learning rate (1e-3) for 10 steps: the first update
already breaks the replies; the first-update guard (`update_kl`) sees it at step 1 and the remedy goes back to the
preset's rate from the state before step 1. `control_default`, `control_math` and `control_smollm2`: the same
presets and rules without the pathology (an arm that acts there is a false alarm).
Arms (`ARMS`): the rule's action record (no action), stop, rollback (to the newest state kept before the trouble,
in memory, with new sampling seeds; with no rollback left, a stop with that state as the last checkpoint), a stop
with the state from before the trouble at once (`back_stop`: a rollback rule with `health.max_rollbacks=0`),
rollback with the scenario's remedy, and RAGEN's reward-variance filter from
the start (top-p 0.9 of the groups by reward spread, softmax weights) with no action.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
from pathlib import Path

from false_alarms import run_grid, run_one, validation
from rldynamics.tracking.run_dir import ROLLED_BACK, read_events, read_metrics
from rldynamics.train.checkpoint import checkpoint_step, latest_checkpoint

SMOLLM2_SHORT = ["train.steps=10", "val.every=10"]  # 9-14 min a run, two at a time (AMD EPYC Zen 3, AVX2)
SCENARIOS = {  # name -> (preset, overrides, the rule that acts, the remedy of the `remedy` arm)
    "lr100": ("sokoban-tiny", ["train.lr=3e-2", "train.steps=30", "val.every=10", "val.env_groups=128"],
              "policy_drift", "train.lr*=0.01"),
    "entropy_bonus": ("math-tiny", ["algo.entropy_coef=0.5", "train.steps=40", "val.every=10", "val.env_groups=128"],
                      "entropy_surge", "algo.entropy_coef=0.0"),
    # SmolLM2-135M: the atlas's blow-up (100 x the preset's learning rate, no refused update) caught by the first-update
    # guard, whose rollback goes back to the state before step 1
    "blowup_smollm2": ("math-smollm2", ["train.lr=1e-3", "health.grad_spike=warn", *SMOLLM2_SHORT], "update_kl",
                       "train.lr*=0.01"),
    # healthy controls: the same presets and acting rules without the pathology (no arm should act)
    "control_default": ("sokoban-tiny", ["train.steps=30", "val.every=10", "val.env_groups=128"], "policy_drift",
                        "train.lr*=0.01"),
    "control_math": ("math-tiny", ["train.steps=40", "val.every=10", "val.env_groups=128"], "entropy_surge",
                     "algo.entropy_coef=0.0"),
    "control_smollm2": ("math-smollm2", SMOLLM2_SHORT, "update_kl", "train.lr*=0.01"),
}
ARMS = {  # name -> the acting rule's settings, given the rule and the scenario's remedy
    "none": lambda rule, remedy: [f"health.{rule}=record"],
    "stop": lambda rule, remedy: [f"health.{rule}=stop"],
    "rollback": lambda rule, remedy: [f"health.{rule}=rollback"],
    "back_stop": lambda rule, remedy: [f"health.{rule}=rollback", "health.max_rollbacks=0"],
    "remedy": lambda rule, remedy: [f"health.{rule}=rollback", f"health.remedy=[{remedy}]"],
    "filter": lambda rule, remedy: [f"health.{rule}=record", *RAGEN_FILTER],
}
RAGEN_FILTER = ["filter.strategy=top_p", "filter.value=0.9", "filter.prob_mode=softmax"]  # RAGEN's filtered variant


def run(scenario: str, arm: str, seed: int, out: Path) -> Path:
    """One run of `scenario` under `arm` with `seed`."""
    preset, overrides, rule, remedy = SCENARIOS[scenario]
    return run_one(preset, seed, out / f"{scenario}-{arm}", None,
                   [*overrides, *ARMS[arm](rule, remedy), "log.progress=false"])


def left_success(run: Path) -> float | None:
    """The validation success of the policy `run` leaves, its last checkpoint: the run's validation of that step,
    or one validation of the checkpoint (`rldyn eval`, run once into <run>/eval/) where the run did not validate
    it (a stop after its last validation, or one that left the state of an earlier step); a run without
    checkpoints, its last validation."""
    val = {step: success for step, success, _ in validation(run)}
    latest = latest_checkpoint(run)
    last = checkpoint_step(latest) if latest is not None else None
    if last is None or last in val:
        return val.get(last, list(val.values())[-1] if val else None)
    out = run / "eval" / f"step_{last}"
    if not (out / "metrics.jsonl").is_file():
        subprocess.run([sys.executable, "-m", "rldynamics.cli", "eval", str(run / "checkpoints" / f"step_{last}"),
                        "model.threads=1", f"log.run_dir={out.parent}", f"log.name={out.name}"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=True)
    return validation(out)[-1][1]


def rollbacks(run: Path) -> list[dict]:
    """Every rollback the run made, in the order made: a rollback to an earlier step archives the rows after it,
    earlier rollbacks among them, into `rolled_back/<attempt>/` (each rollback names its own archive)."""
    found = {e["archive"]: e for d in (run, *sorted((run / ROLLED_BACK).glob("attempt_*"))) for e in read_events(d)
             if e["rule"] == "rollback"}
    return [found[a] for a in sorted(found, key=lambda a: int(a.split("_")[1]))]


def mean_se(values: list[float]) -> str:
    """`mean ± SE (n=k)` over seeds."""
    mean = statistics.fmean(values) if values else math.nan
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return f"{mean:.1%} ± {se:.1%} (n={len(values)})"


def summary(runs: list[Path]) -> tuple[str, str, str, str]:
    """The arm's validation success at the start and of the policy it leaves (each mean ± SE over seeds), the
    steps its runs ended at, its actions."""
    starts = [v[0][1] for r in runs if (v := validation(r)) and v[0][0] == 0]
    ends = [v for r in runs if (v := left_success(r)) is not None]
    last = [max(row["step"] for row in read_metrics(r)) for r in runs]
    acts = [f"stop by {e['rule']}" for r in runs for e in read_events(r)
            if e["action"] == "stop" and e["rule"] != "rollback"]
    acts += [f"rollback to {e['step']}" + (f" {e['changes']}" if e.get("changes") else "")
             for r in runs for e in rollbacks(r)]
    counts = {a: acts.count(a) for a in dict.fromkeys(acts)}
    return (mean_se(starts), mean_se(ends), ", ".join(map(str, last)),
            "; ".join(f"{a} x{n}" for a, n in counts.items()) or "none")


def table(out: Path) -> str:
    lines = ["| scenario | arm | validation success at the start | ... of the policy left (± SE over seeds) | "
             "ended at step | actions |", "|---|---|---|---|---|---|"]
    for scenario in SCENARIOS:
        for arm in ARMS:
            runs = sorted((out / f"{scenario}-{arm}" / SCENARIOS[scenario][0]).glob("seed[0-9]*"))
            if runs:
                lines.append(f"| {scenario} | {arm} | " + " | ".join(summary(runs)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("run", "table"))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/rescue"))
    args = parser.parse_args(argv)
    if args.what == "run":
        run_grid(args.out, args.scenarios, args.arms, args.seeds, args.parallel,
                 lambda sc, arm, seed: run(sc, arm, seed, args.out))
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
