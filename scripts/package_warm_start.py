"""Compute a preset's warm start of the tiny model from scratch and store its weights in the package, where
`rldyn train` finds them instead of spending minutes on the warm start (`train/warmstart.py`, `PACKAGED`).

    python scripts/package_warm_start.py [--preset sokoban-tiny] [key=value ...]

Run it after any change to the tiny model, its tokenizer corpus, the env's prompts or the warm start itself: the
cache key then changes, `tests/test_warmstart.py` fails until the packaged file carries the new key, and the old
file can be removed. It uses an empty temporary cache and one torch thread, and prints the file it wrote.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sokoban-tiny")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["RLDYN_CACHE"] = cache
        import torch

        from rldynamics.config import make_config
        from rldynamics.train import warmstart
        from rldynamics.train.setup import base_model_path

        torch.set_num_threads(1)
        packaged, warmstart.PACKAGED = warmstart.PACKAGED, Path(cache) / "none"  # compute, never copy
        cfg = make_config(args.preset, overrides=["log.progress=false", *args.overrides])
        start = time.perf_counter()
        warm = Path(base_model_path(cfg))
        if "-warm-" not in warm.name:
            sys.exit(f"{args.preset} has no warm start (model.path=tiny and model.warm_start_episodes > 0 need it)")
        packaged.mkdir(parents=True, exist_ok=True)
        target = packaged / f"{warm.name}.safetensors"
        shutil.copyfile(warm / "model.safetensors", target)
        print(f"wrote {target} ({target.stat().st_size / 1e6:.2f} MB) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
