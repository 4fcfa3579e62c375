"""Time per phase of a training step, measured in one run per setting; with several sizes or batch sizes, how
each phase grows with them.

    python bench/step_time.py [--steps 4] [key=value ...]                      # the default preset
    python bench/step_time.py --sizes tiny,h256,h512 --groups 4,8 [--steps 3]  # the scaling table

Each setting runs `rldyn train` for a few steps into a temporary run directory (validation off); the first
step (one-off costs) is dropped and the median seconds per phase over the others are printed with their share
of the step. Sizes are those of `bench/sizes.py` (the embedded tiny model, random Qwen2 weights of hidden
256 / 4 layers and hidden 512 / 8 layers with the tiny tokenizer, or SmolLM2-135M-Instruct with its own
tokenizer); `--groups` sets `train.env_groups` (the batch is groups x `train.group_size`). Several settings end
with one table: seconds per phase, one row each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from rldynamics import metric_names as names
from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train
from sizes import model_dir

PHASES = ("gen", "old_log_prob", "ref", "values", "adv", "update_critic", "gradient_analysis", "update_actor")


def phase_medians(steps: int, overrides: list[str]) -> tuple[dict[str, float], object]:
    """Median seconds of each phase (and `step`) over the steps after the first, and the config used."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(overrides=[f"train.steps={steps}", "val.every=0", "val.before_train=false",
                                     "checkpoint.save_last=false", "log.progress=false", "log.report=false",
                                     f"log.run_dir={tmp}", *overrides])
        rows = read_metrics(train(cfg))[1:]  # the first step pays one-off costs
    out = {p: statistics.median(r[names.timing(p)] for r in rows) for p in PHASES if names.timing(p) in rows[0]}
    out["step"] = statistics.median(r[names.STEP_TIME] for r in rows)
    return out, cfg


def print_phases(times: dict[str, float], cfg, steps: int) -> None:
    print(f"{'phase':<20}{'median s':>10}{'share':>8}   ({steps - 1} steps, batch {cfg.train.env_groups}"
          f"x{cfg.train.group_size}, {torch.get_num_threads()} threads)")
    for phase, t in times.items():
        print(f"{phase:<20}{t:>10.3f}{t / times['step']:>8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sizes", default="", help="comma-separated sizes of bench/sizes.py (default: the preset's)")
    parser.add_argument("--groups", default="", help="comma-separated train.env_groups values")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    table = []
    with tempfile.TemporaryDirectory() as models:
        for size in args.sizes.split(",") if args.sizes else [None]:
            model = [f"model.path={model_dir(size, Path(models))}"] if size else []
            for groups in args.groups.split(",") if args.groups else [None]:
                batch = [f"train.env_groups={groups}"] if groups else []
                times, cfg = phase_medians(args.steps, [*model, *batch, *args.overrides])
                print(f"\n== size {size or 'preset'}, batch {cfg.train.env_groups}x{cfg.train.group_size}")
                print_phases(times, cfg, args.steps)
                table.append((size or "preset", f"{cfg.train.env_groups}x{cfg.train.group_size}", times))
    if len(table) > 1:
        phases = [p for p in (*PHASES, "step") if any(p in t for _, _, t in table)]
        print("\n| size | batch | " + " | ".join(phases) + " |\n|---|---|" + "---:|" * len(phases))
        for size, batch, times in table:
            print(f"| {size} | {batch} | " + " | ".join(f"{times.get(p, 0.0):.2f}" for p in phases) + " |")


if __name__ == "__main__":
    main()
