"""The padded share of the trainer's forwards, measured on a run's step records.

    python bench/padding.py runs/<name> [runs/<name2> ...]

For every recorded step (`records/step_N.safetensors`, written by `record.every=1`), the kept rows are cut into
micro-batches exactly as the update cuts them (`models.forward.row_order` with the run's `train.micro_batch_size`
and `train.shared_prefix`) and three counts of token positions are taken:

- forwarded: what the update's forward computes today: each micro-batch trimmed to its longest row, or, with a
  shared prompt, each distinct prompt once plus every row's suffix padded to the longest suffix
  (`models.forward._forwarded_tokens`);
- real: the rows' attended tokens, each row whole (what packing without sharing a prompt forwards);
- distinct: each distinct prompt once and each row's suffix (what packing that keeps the shared prompt forwards).

The padded share is 1 - distinct / forwarded: the part of the body's forward spent on padding.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from rldynamics.models.forward import _forwarded_tokens, prefix_groups, row_order
from rldynamics.tracking.step_records import RecordedStep, records


def counts(record: RecordedStep, micro: int, shared: bool) -> tuple[int, int, int]:
    """(forwarded, real, distinct) token positions of the kept rows of one record."""
    kept = torch.as_tensor(record.kept_rows)
    ids = torch.as_tensor(record.input_ids).long()[kept]  # [M, L]
    attn = torch.as_tensor(record.attention_mask).long()[kept]  # [M, L]
    resp = torch.as_tensor(record.response_mask).bool()[kept]  # [M, L]
    order = row_order(ids, attn, resp, micro, shared)
    first, labels = prefix_groups(ids, resp)
    lengths = attn.sum(1).tolist()
    if not shared:
        labels = [-1 - i for i in range(len(labels))]
    forwarded = _forwarded_tokens(order.tolist(), lengths, first.tolist(), labels, micro)
    prefixes = {label: f for label, f in zip(labels, first.tolist(), strict=True) if label >= 0}
    distinct = sum(prefixes.values()) + sum(n - (f if label >= 0 else 0)
                                            for n, f, label in zip(lengths, first.tolist(), labels, strict=True))
    return forwarded, sum(lengths), distinct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    print("| run | steps | rows | forwarded | real | distinct | padded share | packing, prompt shared / today |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for run in args.runs:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        micro, shared = cfg["train"]["micro_batch_size"], cfg["train"]["shared_prefix"]
        totals, steps, rows = [0, 0, 0], 0, 0
        for path in records(run):
            record = RecordedStep.read(path)
            totals = [a + b for a, b in zip(totals, counts(record, micro, shared), strict=True)]
            steps, rows = steps + 1, rows + len(record.kept_rows)
        forwarded, real, distinct = totals
        print(f"| {run.name} | {steps} | {rows} | {forwarded} | {real} | {distinct} | {1 - distinct / forwarded:.1%} "
              f"| {distinct / forwarded:.3f} |")


if __name__ == "__main__":
    main()
