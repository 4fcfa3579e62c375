"""Seconds per step with the next rollout overlapping the update (`rollout.overlap`), against the same lag taking
turns and against the on-policy run, in one run of alternating processes.

    python bench/overlap.py [--rounds 2] [--steps 4] [--preset math-smollm2] [key=value ...]

Arms (each round runs them in this order, fresh processes, `--steps` steps each, the first step dropped):
- `on-policy`: the preset as it is;
- `lag 1`: `rollout.staleness=1 train.row_seeded_sampling=true`, rollout and update taking turns;
- `lag 1 overlapped`: the same with `rollout.overlap=true` (the same samples and weights as `lag 1`, bit for bit).

Printed: the median seconds of the step, the generation (`timing_s/gen`, in its own thread when overlapped), the
wait for it (`timing_s/gen_wait`) and the actor update per arm; the ratios of the step times; and the limit of the
overlap, (generation + update) / the larger of the two, from `lag 1`'s medians: what a step would gain if nothing
but those two phases took time and they shared no core. Name the CPU and the load beside any figure.
"""

from __future__ import annotations

import argparse

from paired_steps import OURS, medians, run_steps

LAG = ["rollout.staleness=1", "train.row_seeded_sampling=true"]
ARMS = {"on-policy": [], "lag 1": LAG, "lag 1 overlapped": [*LAG, "rollout.overlap=true"]}
SHOWN = ("step", "gen", "gen_wait", "update_actor")


def limit(m: dict[str, float]) -> float:
    """(generation + update) / the larger of the two: the most a step of these phases gains by overlapping them."""
    gen, update = m.get("gen", 0.0), m.get("update_actor", 0.0)
    return (gen + update) / max(gen, update)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--preset", default="math-smollm2")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    got: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for round_ in range(args.rounds):
        for arm, extra in ARMS.items():
            rows = run_steps(OURS, args.preset, args.steps, [*args.overrides, *extra])
            got[arm] += rows
            print(f"round {round_ + 1} {arm}: " + ", ".join(f"{r['step']:.2f}" for r in rows) + " s", flush=True)
    m = {arm: medians(rows) for arm, rows in got.items()}
    print(f"\n{args.preset} {' '.join(args.overrides)}: {len(got['lag 1'])} steps an arm")
    print("| arm | " + " | ".join(f"{k} s" for k in SHOWN) + " |\n|---|" + "---:|" * len(SHOWN))
    for arm, row in m.items():
        print(f"| {arm} | " + " | ".join(f"{row.get(k, 0.0):.2f}" for k in SHOWN) + " |")
    over = m["lag 1 overlapped"]["step"]
    print(f"\nlag 1 / overlapped: {m['lag 1']['step'] / over:.2f}; on-policy / overlapped: "
          f"{m['on-policy']['step'] / over:.2f}; the limit (gen + update) / max: {limit(m['lag 1']):.2f}")


if __name__ == "__main__":
    main()
