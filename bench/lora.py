"""LoRA against full fine-tuning on SmolLM2-135M-Instruct: step time, peak memory, and the probe's time and memory.

    python bench/lora.py [--steps 3] [--rank 16] [--out /tmp/bench_lora]

For each mode (full fine-tuning, then LoRA rank `--rank` on peft's `all-linear` modules) it trains `math-smollm2` for
`--steps` steps in a process of its own (no validation, one checkpoint at the end), then probes that checkpoint with
`rldyn probe` (one gradient-analysis pass, in a process of its own), and prints per mode:

  trained      parameters the optimizer updates
  step s       mean `timing_s/step` over the steps after the first (the first compiles and warms caches)
  update s     mean `timing_s/update_actor` over the same steps
  peak RSS     the training process's peak resident memory (`ru_maxrss`: weights, optimizer state, activations,
               allocator caches), then the probe process's
  probe s      the probe's `timing_s/gradient_analysis`

and the ratios LoRA / full. Both modes run in one invocation, one after the other, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rldynamics import metric_names as names
from rldynamics.train.diagnostics.records import RECORDS_OFF

PRESET = "math-smollm2"
SMALL = ["val.before_train=false", "val.every=0", "log.progress=false", "log.report=false", *RECORDS_OFF]


def peak_of(args: list[str]) -> int:
    """Run `args` in a child process (through a fresh interpreter, so the peak is the child's own); its peak RSS in
    bytes."""
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", probe, *args], check=True, capture_output=True, text=True)
    return int(done.stdout.split()[-1]) * 1024  # Linux reports KiB


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def measure(mode: str, extra: list[str], steps: int, out: Path) -> dict:
    """Train, then probe, one mode; its figures."""
    cli = [sys.executable, "-m", "rldynamics.cli"]
    train_peak = peak_of([*cli, "train", "--nproc", "1", "--preset", PRESET, *SMALL, f"train.steps={steps}",
                          f"checkpoint.every={steps}", f"log.run_dir={out}", f"log.name={mode}", *extra])
    run = out / mode
    trained = [r for r in rows(run) if names.STEP_TIME in r][1:]
    probe_peak = peak_of([*cli, "probe", str(run / "checkpoints" / f"step_{steps}"), "log.progress=false",
                          f"log.run_dir={out}", f"log.name={mode}_probe", "analysis.num_buckets=2"])
    probe = rows(out / f"{mode}_probe")[-1]
    environment = json.loads((run / "environment.jsonl").read_text().splitlines()[-1])
    return {"trained": probe.get(names.ANALYSIS_PARAMETERS), "step": mean([r[names.STEP_TIME] for r in trained]),
            "update": mean([r[names.timing("update_actor")] for r in trained]), "train_peak": train_peak,
            "probe": probe.get(names.timing("gradient_analysis")), "probe_peak": probe_peak,
            "cpu": environment.get("cpu_model"), "threads": environment.get("threads"),
            "dtype": environment.get("compute_dtype")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_lora_"))
    lora = [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}"]
    found = {"full": measure("full", [], args.steps, out), "lora": measure("lora", lora, args.steps, out)}
    print(f"{PRESET}, {args.steps} steps, CPU {found['full']['cpu']}, {found['full']['threads']} threads, compute "
          f"{found['full']['dtype']}; runs in {out}")
    print(f"{'mode':6} {'trained':>12} {'step s':>8} {'update s':>9} {'train peak MiB':>15} {'probe s':>8} "
          f"{'probe peak MiB':>15}")
    for mode, f in found.items():
        print(f"{mode:6} {f['trained'] or 0:>12,.0f} {f['step']:>8.2f} {f['update']:>9.2f} "
              f"{f['train_peak'] / 2**20:>15.0f} {f['probe'] or float('nan'):>8.2f} {f['probe_peak'] / 2**20:>15.0f}")
    full, lo = found["full"], found["lora"]
    print(f"LoRA / full: step {lo['step'] / full['step']:.2f}, update {lo['update'] / full['update']:.2f}, train peak "
          f"{lo['train_peak'] / full['train_peak']:.2f}, probe {(lo['probe'] or 0) / (full['probe'] or 1):.2f}, probe "
          f"peak {lo['probe_peak'] / full['probe_peak']:.2f}")


if __name__ == "__main__":
    main()
