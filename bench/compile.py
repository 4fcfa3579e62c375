"""Seconds per step with parts of the actor compiled by `torch.compile` (inductor, CPU), against the eager model, in
one run of alternating processes.

    python bench/compile.py [--rounds 2] [--steps 4] [--preset math-smollm2] [--arms eager,mlp,block] [key=value ...]

Arms (each round runs them in this order, fresh processes, `--steps` steps each; the first step, which compiles, is
dropped and printed apart):
- `eager`: the preset as it is;
- `mlp`: in every decoder block the MLP and both RMSNorms compiled (`module.compile(dynamic=True)`): the
  element-wise work a fused kernel can take (SiLU x up, the norms) and nothing that touches a key/value cache;
- `block`: every decoder block compiled whole (regional compilation, as transformers documents it).

The compiled modules serve every call of the actor: generation (HF engine) as well as the update. Nothing here is a
setting of the trainer: the worker process loads the model as `rldyn train` does and compiles the regions before
the run starts (`rldynamics.train.setup.prepare`, wrapped). Printed: the median seconds of the step, the generation
and the actor update per arm, the first step's seconds (compilation included), and each arm's step time against
eager. Name the CPU and the load beside any figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from paired_steps import OURS, QUIET, medians, side_env, timings

ARMS = ("eager", "mlp", "block")
SHOWN = ("step", "gen", "update_actor")


def compile_regions(model, arm: str) -> None:
    """Compile the regions of `arm` in every decoder block of `model` (a causal LM, possibly wrapped)."""
    import torch._functorch.config

    # the gradient analysis backpropagates one forward several times (retain_graph): compiled backward graphs must
    # then keep their saved buffers (with the default, the analysis step fails with "non-empty donated buffers")
    torch._functorch.config.donated_buffer = False
    base = model
    while not hasattr(base, "layers"):
        base = base.model
    for block in base.layers:
        if arm == "block":
            block.compile(dynamic=True)
        else:
            for module in (block.mlp, block.input_layernorm, block.post_attention_layernorm):
                module.compile(dynamic=True)


def worker(arm: str, args: list[str]) -> None:
    """`rldyn ARGS` in this process with the actor's regions of `arm` compiled (the first model prepared)."""
    from rldynamics.cli import main
    from rldynamics.train import setup

    prepare = setup.prepare
    actor_done = arm == "eager"  # the actor is the first model prepared (then the reference, a critic)

    def prepare_and_compile(model, cfg, precision):
        nonlocal actor_done
        model = prepare(model, cfg, precision)
        if not actor_done:
            compile_regions(model, arm)
            actor_done = True
        return model

    setup.prepare = prepare_and_compile
    sys.argv = ["rldyn", *args]
    sys.exit(main())


def run_arm(arm: str, preset: str, steps: int, overrides: list[str]) -> list[dict[str, float]]:
    """The `timing_s/*` values of every step of one run of `arm`, in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["train", "--preset", preset, f"train.steps={steps}", *QUIET, f"log.run_dir={tmp}", *overrides]
        subprocess.run([sys.executable, __file__, "--worker", arm, "--", *args], check=True,
                       env=side_env(OURS), stdout=subprocess.DEVNULL)
        metrics = next(Path(tmp).glob("*/metrics.jsonl"))
        return [timings(json.loads(line)) for line in metrics.read_text().splitlines()]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--preset", default="math-smollm2")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    steady: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    first: dict[str, list[float]] = {a: [] for a in arms}
    for round_ in range(args.rounds):
        for arm in arms:
            rows = run_arm(arm, args.preset, args.steps, args.overrides)
            first[arm].append(rows[0]["step"])
            steady[arm] += rows[1:]
            print(f"round {round_ + 1} {arm}: first step {rows[0]['step']:.1f} s, then "
                  + ", ".join(f"{r['step']:.2f}" for r in rows[1:]) + " s", flush=True)
    m = {a: medians(steady[a]) for a in arms}
    print(f"\n{args.preset} {' '.join(args.overrides)}: medians of {len(steady[arms[0]])} steps an arm")
    print("| arm | first step s | " + " | ".join(f"{k} s" for k in SHOWN) + " | eager / arm (step) |")
    print("|---|---:|" + "---:|" * len(SHOWN) + "---:|")
    for arm in arms:
        ratio = m["eager"]["step"] / m[arm]["step"] if "eager" in m else float("nan")
        print(f"| {arm} | {max(first[arm]):.1f} | " + " | ".join(f"{m[arm].get(k, 0.0):.2f}" for k in SHOWN)
              + f" | {ratio:.2f} |")


if __name__ == "__main__":
    main()
