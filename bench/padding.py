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


def kept(record: RecordedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token ids, attention mask and response mask of the rows the filter kept. ([M, L] each)"""
    rows = torch.as_tensor(record.kept_rows)
    return (torch.as_tensor(record.input_ids).long()[rows], torch.as_tensor(record.attention_mask).long()[rows],
            torch.as_tensor(record.response_mask).bool()[rows])


def counts(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor, micro: int,
           shared: bool) -> tuple[int, int, int]:
    """(forwarded, real, distinct) token positions of the kept rows [M, L] of one record."""
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


BUDGETS = {"1x the longest row": 1, "4x the longest row": 4, "no bound": None}


def packing(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor,
            micro: int) -> tuple[dict[str, list[int]], int]:
    """Packed [tokens, squared widths] per bound of `BUDGETS` (`packed_tokens`) over the micro-batches of the kept
    rows [M, L] of one record, and the micro-batches' rows x width² padded to their longest row."""
    order = row_order(ids, attn, resp, micro, True).tolist()
    first, labels = prefix_groups(ids, resp)
    first, lengths = first.tolist(), attn.sum(1).tolist()
    out, padded = {name: [0, 0] for name in BUDGETS}, 0
    for start in range(0, len(order), micro):
        rows = order[start:start + micro]
        width = max(lengths[r] for r in rows)
        for name, factor in BUDGETS.items():
            tokens, squares = packed_tokens(first, labels, lengths, rows, 10**9 if factor is None else factor * width)
            out[name] = [out[name][0] + tokens, out[name][1] + squares]
        padded += len(rows) * width * width
    return out, padded


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
        packed, padded = {name: [0, 0] for name in BUDGETS}, 0
        for path in records(run):
            tensors = kept(RecordedStep.read(path))
            totals = [a + b for a, b in zip(totals, counts(*tensors, micro, shared), strict=True)]
            steps, rows = steps + 1, rows + len(tensors[0])
            per_budget, squares = packing(*tensors, micro)
            packed = {name: [a + b for a, b in zip(packed[name], per_budget[name], strict=True)] for name in BUDGETS}
            padded += squares
        forwarded, real, distinct = totals
        print(f"| {run.name} | {steps} | {rows} | {forwarded} | {real} | {distinct} | {1 - distinct / forwarded:.1%} "
              f"| {distinct / forwarded:.3f} |")
        packs.append((run.name, forwarded, packed, padded))
    print("\n| run | packed rows of at most | tokens | / today's forwarded | squared widths / rows x width² |")
    print("|---|---|---:|---:|---:|")
    for name, forwarded, packed, padded in packs:
        for bound, (tokens, squares) in packed.items():
            print(f"| {name} | {bound} | {tokens} | {tokens / forwarded:.3f} | {squares / padded:.2f} |")


if __name__ == "__main__":
    main()
