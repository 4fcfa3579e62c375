"""Time per phase of a training step on the default preset (or any overrides), measured in one run.

    python bench/step_time.py [--steps 4] [key=value ...]

Runs `rldyn train` for a few steps into a temporary run directory (validation off) and prints, per phase,
the median seconds over the steps after the first and its share of the step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from transformers.utils import logging as hf_logging

from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train

PHASES = ("gen", "old_log_prob", "ref", "values", "adv", "update_critic", "gradient_analysis", "update_actor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(overrides=[f"train.steps={args.steps}", "val.every=0", "val.before_train=false",
                                     "checkpoint.save_last=false", "log.progress=false", "log.report=false",
                                     f"log.run_dir={tmp}",
                                     *args.overrides])
        rows = read_metrics(train(cfg))[1:]  # the first step pays one-off costs
    step = statistics.median(r["timing_s/step"] for r in rows)
    print(f"{'phase':<20}{'median s':>10}{'share':>8}   ({len(rows)} steps, batch {cfg.train.env_groups}"
          f"x{cfg.train.group_size}, {torch.get_num_threads()} threads)")
    for phase in PHASES:
        values = [r[f"timing_s/{phase}"] for r in rows if f"timing_s/{phase}" in r]
        if values:
            t = statistics.median(values)
            print(f"{phase:<20}{t:>10.3f}{t / step:>8.1%}")
    print(f"{'step':<20}{step:>10.3f}{1:>8.0%}")


if __name__ == "__main__":
    main()
