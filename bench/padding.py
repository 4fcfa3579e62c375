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

Then what packing would forward: each micro-batch's rows laid one after another in packed rows of at most
`budget` tokens, each distinct prompt once per packed row and every row's suffix after it (a prompt is repeated
in each packed row its group's rows spill into), for budgets of 1x and 4x the micro-batch's longest row and
without a bound; beside each, the sum of squared packed widths against today's (the attention's cost grows with
it: attention runs over the whole packed row), against rows x width² of the micro-batch padded to its longest row.
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


def packed_tokens(first: list[int], labels: list[int], lengths: list[int], rows: list[int],
                  budget: int) -> tuple[int, int]:
    """(tokens, sum of squared widths) of one micro-batch's `rows` packed into rows of at most `budget` tokens."""
    groups: dict[int, list[int]] = {}
    for r in rows:
        groups.setdefault(labels[r], []).append(r)
    widths, width, present = [], 0, set()
    for label, members in groups.items():
        for r in members:
            need = lengths[r] - first[r] + (0 if label in present else first[r])
            if width and width + need > budget:
                widths.append(width)
                width, present = 0, set()
                need = lengths[r]
            width += need
            present.add(label)
    widths.append(width)
    return sum(widths), sum(w * w for w in widths)


def packing(record: RecordedStep, micro: int) -> dict[str, tuple[int, int]]:
    """Packed tokens and squared widths per budget (`packed_tokens`), and today's (`today`), of one record."""
    kept = torch.as_tensor(record.kept_rows)
    ids = torch.as_tensor(record.input_ids).long()[kept]  # [M, L]
    attn = torch.as_tensor(record.attention_mask).long()[kept]  # [M, L]
    resp = torch.as_tensor(record.response_mask).bool()[kept]  # [M, L]
    order = row_order(ids, attn, resp, micro, True).tolist()
    first, labels = prefix_groups(ids, resp)
    first, lengths = first.tolist(), attn.sum(1).tolist()
    out = dict.fromkeys(("1x", "4x", "unbounded", "today"), (0, 0))
    for start in range(0, len(order), micro):
        rows = order[start:start + micro]
        width = max(lengths[r] for r in rows)
        for name, budget in (("1x", width), ("4x", 4 * width), ("unbounded", 10**9)):
            t, sq = packed_tokens(first, labels, lengths, rows, budget)
            out[name] = (out[name][0] + t, out[name][1] + sq)
        out["today"] = (0, out["today"][1] + len(rows) * width * width)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    print("| run | steps | rows | forwarded | real | distinct | padded share | packing, prompt shared / today |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    packs = []
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
        packs.append((run.name, forwarded, [packing(RecordedStep.read(p), micro) for p in records(run)]))
    print("\n| run | packed rows of at most | tokens | / today's forwarded | squared widths / rows x width² |")
    print("|---|---|---:|---:|---:|")
    for name, forwarded, per_record in packs:
        today_sq = sum(r["today"][1] for r in per_record)
        for budget in ("1x", "4x", "unbounded"):
            tokens, sq = sum(r[budget][0] for r in per_record), sum(r[budget][1] for r in per_record)
            bound = "no bound" if budget == "unbounded" else f"{budget} the longest row"
            print(f"| {name} | {bound} | {tokens} | {tokens / forwarded:.3f} | {sq / today_sq:.2f} |")


if __name__ == "__main__":
    main()
