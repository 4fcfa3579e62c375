"""Head to head: rldynamics' health monitor against stand-alone "RL doctor" packages, on pathology runs and healthy
runs (docs/doctors.md).

    python bench/doctors.py run [--scenarios sign_flip,...] [--seeds 0-2] [--runs runs]   # the new pathology runs
    python bench/doctors.py table [--runs runs] [--python .venv-doctors/bin/python]    # the tables

`run` trains math-tiny (40 steps, validation every 10 on 128 groups) once per seed and scenario of `NEW`, each as its
own `rldyn train` process into RUNS/doctors/<scenario>/math-tiny/seed<s> (`false_alarms.run_one`: one torch thread,
a finished run skipped).

`table` reads the run directories alone (`PATHOLOGIES`, `HEALTHY`). It converts each run's logs (metrics.jsonl,
rewards.jsonl, config.yaml) into each tool's own input (`convert`), hands them to `doctors_tools.py` run by PYTHON,
a virtual environment holding the tools (they are no dependency of this project), and judges the same logs with the
health rules of this checkout at their default settings (`ours`: `rldyn doctor`'s replay; actions above record).
Each tool sees the logs of steps 1..t for every t in turn, as if run after every step; its first alarm is the first
t at which it reports a finding at its warning level or above. Per scenario and tool: the runs flagged, the first
alarm step, the lead (the step training success fell, `atlas.fall`, minus the first alarm: positive = before it
fell), and on the healthy runs the runs with any alarm (false alarms); first how each tool was fed, last what fired
in each run (detector@first step). Every alarm comes from the tool's own rules, except rlvr-audit's: it gives
verdicts per prompt and no run-level alarm, so a step counts when none of its prompts is HEALTHY or it lists an
anomaly (`doctors_tools.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from atlas import fall
from rldynamics import metric_names as names
from rldynamics.tracking.run_dir import read_config, read_metrics, read_rewards

PRESET = "math-tiny"
SHORT = ["train.steps=40", "val.every=10", "val.env_groups=128", "log.progress=false"]
NEW = {  # scenario -> its overrides of math-tiny, each meant to break the run its own way
    "sign_flip": ["env.reward_weights.correctness=-1"],  # wrong answers pay
    "length_only": ["env.reward_weights.correctness=0", "env.reward_weights.format=0",
                    "env.reward_weights.length=1"],  # only the reply's length pays
    "entropy_penalty": ["algo.entropy_coef=-5"],  # entropy is punished
    "clip10": ["algo.clip_low=0.99", "algo.clip_high=10"],  # no trust region (clip_low must stay below 1)
}
PATHOLOGIES = {  # scenario -> its runs' directory under RUNS (seed<s> in it)
    "lr100": "rescue/lr100-none/sokoban-tiny",  # sokoban-tiny, 100 x the learning rate (bench/rescue.py)
    "entropy_bonus": "rescue/entropy_bonus-none/math-tiny",  # math-tiny, entropy bonus 0.5 (bench/rescue.py)
    **{name: f"doctors/{name}/{PRESET}" for name in NEW},
}
HEALTHY = {  # preset -> its healthy runs (bench/false_alarms.py)
    "sokoban-tiny": "false_alarms/sokoban-tiny", "bandit-tiny": "false_alarms_presets/bandit-tiny",
    "countdown-tiny": "false_alarms_presets/countdown-tiny", "frozenlake-tiny": "false_alarms_presets/frozenlake-tiny",
    "math-tiny": "false_alarms_math/math-tiny",
}
TOOLS = {  # column -> (doctors_tools.py's key, how the tool was fed; docs/doctors.md says more)
    "ours": ("", "its own logs: `rldyn doctor`'s replay of this checkout's rules, default settings"),
    "rlwatch 0.5.1": ("rlwatch", "converted: its manual API, `RLWatch.log_step` once per step"),
    "rlprobe 0.1.0": ("rlprobe", "converted: a recording in its format (its RunWriter: manifest.json, "
                                 "steps.parquet), its doctor on steps 1..t"),
    "rldoctor 0.2.0": ("rldoctor", "converted: per-step dicts in the verl / TRL names it aliases, "
                                   "`diagnose(run_from_records(...))` on steps 0..t"),
    "rldoctor LiveMonitor": ("rldoctor_live", "the same dicts through its LiveMonitor at its defaults"),
    "rlvr-audit 0.1.0": ("rlvr_audit", "converted: its JSONL, one line per prompt (the group's 0/1 verifier "
                                       "outcomes), `audit_portfolio` per step; the step-level reading is ours"),
}


# -- the conversion: our logs -> each tool's input (plain dicts; doctors_tools.py feeds them) ----------------------

def kl_name(cfg: dict) -> str:
    """The KL a tool reading "KL" gets: the KL to the reference where the run trains with one (`actor/kl_loss`);
    else the update's PPO KL (with `algo.kl_coef` 0 the reference KL is computed on gradient-analysis steps only and
    logged as 0 on the others, which is no series)."""
    return names.KL_LOSS if cfg["algo"].get("kl_coef", 0) > 0 else names.PPO_KL


def batches(rewards: list[dict]) -> dict[int, list[dict]]:
    """rewards.jsonl's rows by step."""
    out: dict[int, list[dict]] = {}
    for r in rewards:
        out.setdefault(r["step"], []).append(r)
    return out


def reward_stats(rows: list[dict]) -> dict[str, float]:
    """Mean, population std, min and max of one step's trained rewards (`total`)."""
    xs = [float(r["total"]) for r in rows]
    return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs), "min": min(xs), "max": max(xs)}


def _pick(row: dict, mapping: dict[str, str]) -> dict[str, float]:
    """{their name: our value} for the names of `mapping` (theirs -> ours) logged in `row`."""
    return {theirs: float(row[ours]) for theirs, ours in mapping.items() if ours in row and row[ours] is not None}


def training_rows(metrics: list[dict]) -> list[dict]:
    """The rows of training steps (step >= 1; the step-0 row is the validation before training)."""
    return [r for r in metrics if r["step"] >= 1]


def rlwatch_input(metrics: list[dict], steps: dict[int, list[dict]], cfg: dict) -> list[list]:
    """[step, RLWatch.log_step's keyword arguments] per training step; `rewards`: the step's trained rewards."""
    mapping = {"entropy": names.ENTROPY, "kl_divergence": kl_name(cfg), "loss": names.PG_LOSS,
               "learning_rate": names.ACTOR_LR, "clip_fraction": names.PG_CLIPFRAC, "grad_norm": names.ACTOR_GRAD_NORM}
    out = []
    for row in training_rows(metrics):
        kwargs = _pick(row, mapping)
        if steps.get(row["step"]):
            stats = reward_stats(steps[row["step"]])
            kwargs |= {"reward_mean": stats["mean"], "reward_std": stats["std"],
                       "rewards": [float(r["total"]) for r in steps[row["step"]]]}
        out.append([row["step"], kwargs])
    return out


def rlprobe_input(metrics: list[dict], steps: dict[int, list[dict]], cfg: dict) -> dict:
    """rlprobe's RunManifest fields and one StepRecord (its field names) per training step."""
    mapping = {"entropy_mean": names.ENTROPY, "kl_mean": kl_name(cfg), "clip_fraction": names.PG_CLIPFRAC,
               "adv_mean": names.advantages("mean"), "zero_variance_group_frac": names.HEALTH_ZERO_VARIANCE_SHARE,
               "loss": names.PG_LOSS, "lr": names.ACTOR_LR, "grad_norm": names.ACTOR_GRAD_NORM,
               "completion_len_mean": names.RESPONSE_LENGTH_MEAN,
               "completion_len_max": names.response_length("max"), "truncation_rate": names.RESPONSE_CLIP_RATIO,
               "max_len_hit_frac": names.RESPONSE_CLIP_RATIO, "repetition_rate": names.HEALTH_REPETITION_RATE,
               "step_time_s": names.STEP_TIME, "generation_time_s": names.timing("gen")}
    records = []
    for row in training_rows(metrics):
        record = {"step": row["step"], **_pick(row, mapping)}
        if steps.get(row["step"]):
            record |= {f"reward_{k}": v for k, v in reward_stats(steps[row["step"]]).items()}
        components = {c: float(v) for k, v in row.items() if (p := names.parse_reward_component(k)) and p[1] == "mean"
                      for c in [p[0]]}
        if components:
            record["reward_components"] = components
        norm = row.get(names.ACTOR_GRAD_NORM)
        if norm is not None and not math.isfinite(norm):  # an optimizer step skipped for a non-finite gradient
            record["nan_count"] = int(row.get(names.SKIPPED_STEPS, 1))
        records.append(record)
    manifest = {"run_id": "", "created_at": "", "algorithm": cfg["algo"]["adv_estimator"],
                "trainer_config": {"lr": cfg["train"]["lr"], "group_size": cfg["train"]["group_size"]}}
    return {"manifest": manifest, "steps": records}


def rldoctor_input(metrics: list[dict], steps: dict[int, list[dict]], cfg: dict, env: str) -> dict:
    """rl-doctor's per-step dicts, in the verl / TRL names its alias table lists, and its config keys. The step-0
    row carries the validation before training only."""
    mapping = {"actor/entropy": names.ENTROPY, kl_name(cfg): kl_name(cfg), "actor/pg_clipfrac": names.PG_CLIPFRAC,
               "actor/pg_clipfrac_lower": names.PG_CLIPFRAC_LOWER, "actor/grad_norm": names.ACTOR_GRAD_NORM,
               "actor/lr": names.ACTOR_LR, "actor/pg_loss": names.PG_LOSS,
               "critic/advantages/mean": names.advantages("mean"),
               "frac_reward_zero_std": names.HEALTH_ZERO_VARIANCE_SHARE,
               "response_length/mean": names.RESPONSE_LENGTH_MEAN, "response_length/max": names.response_length("max"),
               "response_length/clip_ratio": names.RESPONSE_CLIP_RATIO, "timing_s/step": names.STEP_TIME,
               "val/test_score": names.val_success(env)}
    records = []
    for row in metrics:
        record = {"step": row["step"], **_pick(row, mapping)}
        if steps.get(row["step"]):
            record |= {f"critic/score/{k}": v for k, v in reward_stats(steps[row["step"]]).items()}
        record |= {f"rewards/{p[0]}/mean": float(v) for k, v in row.items()
                   if (p := names.parse_reward_component(k)) and p[1] == "mean"}
        records.append(record)
    algo = cfg["algo"]
    config = {"algorithm": algo["adv_estimator"], "group_size": cfg["train"]["group_size"],
              "batch_size": cfg["train"]["env_groups"] * cfg["train"]["group_size"],
              "max_response_length": cfg["env"]["max_new_tokens"], "kl_coef": algo["kl_coef"],
              "entropy_coef": algo["entropy_coef"], "clip_eps_low": algo["clip_low"],
              "clip_eps_high": algo["clip_high"], "learning_rate": cfg["train"]["lr"]}
    return {"config": config, "records": records}


def rlvr_audit_input(steps: dict[int, list[dict]], cfg: dict) -> dict:
    """rlvr-audit's JSONL lines, one per prompt (group) of each step: `prompt_id` and the group's 0/1 verifier
    outcomes (`correct`), in the group's order."""
    out = []
    for step in sorted(steps):
        groups: dict[int, list[dict]] = {}
        for r in sorted(steps[step], key=lambda r: r["traj"]):
            groups.setdefault(r["group"], []).append(r)
        out.append([step, [{"prompt_id": f"step{step}-prompt{g[0]['prompt']}",
                            "rewards": [1.0 if r["correct"] else 0.0 for r in g]} for g in groups.values()]])
    return {"G": cfg["train"]["group_size"], "steps": out}


def env_of(cfg: dict) -> str:
    return cfg["env"]["name"]


def convert(run: Path) -> dict:
    """Every tool's input from one run directory."""
    metrics, cfg = read_metrics(run), read_config(run)
    steps = batches(read_rewards(run))
    return {"run": str(run), "rlwatch": rlwatch_input(metrics, steps, cfg),
            "rlprobe": rlprobe_input(metrics, steps, cfg), "rldoctor": rldoctor_input(metrics, steps, cfg, env_of(cfg)),
            "rlvr_audit": rlvr_audit_input(steps, cfg)}


# -- judging --------------------------------------------------------------------------------------------------------

def ours(run: Path) -> dict[str, int]:
    """rule -> the first step it fired above record, with this checkout's rules at their default settings (the
    rescue runs' arm `none` had turned their acting rule down to record)."""
    from false_alarms import ABOVE_RECORD  # it and the replay pull in the plotting stack: imported where used
    from rldynamics.config import make_config
    from rldynamics.integrations.doctor import diagnose, read_logs

    logs = read_logs(run)
    logs.health = make_config(None).health
    first: dict[str, int] = {}
    for e in diagnose(logs).events:
        if e.get("action") in ABOVE_RECORD:
            first.setdefault(e["rule"], e["step"])
    return first


def tools(runs: list[Path], python: str) -> dict[str, dict]:
    """run -> doctors_tools.py's key -> {detector: first step}, computed in the tools' environment."""
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "inputs.json"
        file.write_text(json.dumps([convert(r) for r in runs]))
        done = subprocess.run([python, str(Path(__file__).with_name("doctors_tools.py")), str(file)],
                              capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def judged(runs: list[Path], python: str) -> dict[str, dict]:
    """run -> {column of `TOOLS`: {detector: first step}, "fell": the step success fell}."""
    theirs = tools(runs, python)
    out = {}
    for run in runs:
        found = {column: theirs[str(run)][key] for column, (key, _) in TOOLS.items() if key}
        out[str(run)] = {"ours": ours(run), **found, "fell": fell(run)}
    return out


def fell(run: Path) -> int | None:
    """The step training success fell (`atlas.fall`); its start is the step-0 validation only where that samples at
    the training temperature (the presets here validate at 0.5 and train at 1.0: training success at step 1)."""
    cfg = read_config(run)
    return fall(read_metrics(run), env_of(cfg), cfg["val"]["temperature"] == cfg["train"]["temperature"])[1]


def first_alarm(fired: dict[str, int]) -> int | None:
    return min(fired.values(), default=None)


def spread(xs: list[int]) -> str:
    """`median [min, max]` of whole steps, `-` for none."""
    if not xs:
        return "-"
    med = statistics.median(xs)
    text = f"{med:g}"
    return text if min(xs) == max(xs) else f"{text} [{min(xs)}, {max(xs)}]"


def cell(results: list[dict], tool: str, healthy: bool) -> str:
    """One scenario's cell of one tool: runs flagged (n/N); for a pathology, also the first alarm step and the lead
    (median [min, max] over the runs flagged)."""
    firsts = [first_alarm(r[tool]) for r in results]
    flagged = [f for f in firsts if f is not None]
    count = f"{len(flagged)}/{len(results)}"
    if healthy:
        return count
    leads = [r["fell"] - f for r, f in zip(results, firsts, strict=True) if f is not None and r["fell"] is not None]
    return f"{count}; {spread(flagged)}; {spread(leads)}"


def runs_of(root: Path, where: str) -> list[Path]:
    return sorted((p.parent for p in (root / where).glob("seed*/metrics.jsonl")), key=lambda p: int(p.name[4:]))


def table(root: Path, python: str) -> str:
    groups = {name: runs_of(root, where) for name, where in (PATHOLOGIES | HEALTHY).items()}
    found = judged([r for rs in groups.values() for r in rs], python)
    lines = ["| tool | fed |", "|---|---|", *(f"| {t} | {fed} |" for t, (_, fed) in TOOLS.items()),
             "\nPathology runs: runs flagged n/N; first alarm step; lead = fell - first alarm (median [min, max])\n",
             "| scenario | success fell at | " + " | ".join(TOOLS) + " |", "|---|---|" + "---|" * len(TOOLS)]
    for scenario in PATHOLOGIES:
        results = [found[str(r)] for r in groups[scenario]]
        if results:
            fell_at = spread([r["fell"] for r in results if r["fell"] is not None])
            fell_at += f" ({sum(r['fell'] is not None for r in results)}/{len(results)})"
            lines.append(f"| {scenario} | {fell_at} | " + " | ".join(cell(results, t, False) for t in TOOLS) + " |")
    lines += ["\nHealthy runs: runs with any alarm (false alarms)\n", "| preset | runs | " + " | ".join(TOOLS) + " |",
              "|---|---|" + "---|" * len(TOOLS)]
    total = {t: 0 for t in TOOLS}
    for preset in HEALTHY:
        results = [found[str(r)] for r in groups[preset]]
        for t in TOOLS:
            total[t] += sum(first_alarm(r[t]) is not None for r in results)
        lines.append(f"| {preset} | {len(results)} | " + " | ".join(cell(results, t, True) for t in TOOLS) + " |")
    n = sum(len(groups[p]) for p in HEALTHY)
    lines.append(f"| all | {n} | " + " | ".join(f"{total[t]}/{n}" for t in TOOLS) + " |")
    lines += ["\nWhat fired, per run (detector@first step)\n", "| run | fell | " + " | ".join(TOOLS) + " |",
              "|---|---|" + "---|" * len(TOOLS)]
    for name, runs in groups.items():
        for run in runs:
            r = found[str(run)]
            cells = [", ".join(f"{d}@{s}" for d, s in sorted(r[t].items(), key=lambda kv: kv[1])) or "-" for t in TOOLS]
            fell_at = "" if name in HEALTHY else r["fell"] or "-"
            lines.append(f"| {name}/{run.name} | {fell_at} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("run", "table"))
    parser.add_argument("--scenarios", default=",".join(NEW))
    parser.add_argument("--seeds", default="0-2")
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--python", default=".venv-doctors/bin/python",
                        help="the Python of a virtual environment holding the four tools")
    args = parser.parse_args(argv)
    if args.what == "run":
        from false_alarms import run_one, seeds_of

        for scenario in args.scenarios.split(","):
            out = args.runs / "doctors" / scenario
            out.mkdir(parents=True, exist_ok=True)
            for seed in seeds_of(args.seeds):
                print(run_one(PRESET, seed, out, None, [*SHORT, *NEW[scenario]]), flush=True)
        return 0
    print(table(args.runs, args.python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
