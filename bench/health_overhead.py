"""What the health monitor costs: the step time with its default signals and rules on against off, in one run.

    python bench/health_overhead.py [--steps 6] [--rounds 2] [--preset NAME] [key=value ...]

Each round trains the same seeded steps twice, health on (`health.enabled=true`, its default: the rules, the
per-layer gradient norms and update ratios, the entropy covariance) and off, alternating which goes first; the first
step of each run (one-off costs) is dropped. Prints the median step time of each and their ratio, with the median
seconds of the `health` diagnostic and of the actor update. `key=value` overrides pick the preset's settings or
another model (`model.path=smollm2`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from transformers.utils import logging as hf_logging

from rldynamics import metric_names as names
from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train


def timings(preset: str | None, steps: int, overrides: list[str]) -> list[dict]:
    """The metrics rows after the first step of a short run with `overrides`."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(preset, overrides=[f"train.steps={steps}", "val.every=0", "val.before_train=false",
                                     "checkpoint.save_last=false", "log.progress=false", "log.report=false",
                                     f"log.run_dir={tmp}", *overrides])
        return read_metrics(train(cfg))[1:]


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--preset", default=None, help="a preset (default: the default preset)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            runs[on] += timings(args.preset, args.steps, [*args.overrides, f"health.enabled={str(on).lower()}"])
    on, off = median(runs[True], names.STEP_TIME), median(runs[False], names.STEP_TIME)
    print(f"health on : {on:.3f} s/step (health {median(runs[True], names.timing('health')):.3f} s, actor update "
          f"{median(runs[True], names.timing('update_actor')):.3f} s)")
    print(f"health off: {off:.3f} s/step (actor update {median(runs[False], names.timing('update_actor')):.3f} s)")
    print(f"on / off  : {on / off:.3f}  ({len(runs[True])} steps each, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
