"""Regenerate the shipped math sample (src/rldynamics/envs/data/math_sample.jsonl) from the synthetic generator."""

from pathlib import Path

from rldynamics.envs.math_data import write_sample

if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "src" / "rldynamics" / "envs" / "data" / "math_sample.jsonl"
    write_sample(path)
    print(f"wrote {path}")
