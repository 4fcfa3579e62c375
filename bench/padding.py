"""The padded share of the trainer's forwards, padded against packed, measured on a run's step records.

    python bench/padding.py runs/<name> [runs/<name2> ...]

For every recorded step (`records/step_N.safetensors`, written by `record.every=1`), the kept rows are cut into
micro-batches exactly as the update cuts them (`models.forward.row_order` with the run's `train.micro_batch_size`
and `train.shared_prefix`), and per micro-batch the token positions the body forwards are counted
(`models.forward._forwarded_tokens`): each distinct prompt once, then every row's suffix (its tokens from its
first response token; whole rows when no prompt is shared) either padded to the longest suffix (`padded`, the
forward before packing) or packed one after another into rows as wide as the longest (`packed`, the forward
now). `distinct` is what neither wastes: each distinct prompt once and each row's suffix. The padded share is
1 - distinct / forwarded. The attention column is the query x key pairs the packed forward's attention computes
against the padded one's (a packed row's tokens attend over the whole row, masked).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from rldynamics.models.forward import _forwarded_tokens, pack_segments, prefix_groups, row_order
from rldynamics.tracking.step_records import RecordedStep, records


def kept(record: RecordedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token ids, attention mask and response mask of the rows the filter kept. ([M, L] each)"""
    rows = torch.as_tensor(record.kept_rows)
    return (torch.as_tensor(record.input_ids).long()[rows], torch.as_tensor(record.attention_mask).long()[rows],
            torch.as_tensor(record.response_mask).bool()[rows])


def attention_pairs(rows: list[int], lengths: list[int], first: list[int], labels: list[int], pack: bool) -> int:
    """Query x key positions of one micro-batch's suffix forward (each query attends the prefix and its row)."""
    shared = len({labels[i] for i in rows}) < len(rows)
    spans = [lengths[i] - (first[i] if shared else 0) for i in rows]
    prefix = max((first[i] for i in rows), default=0) if shared else 0
    bins = len(pack_segments(spans, [labels[i] if shared else 0 for i in rows], max(spans))) if pack else len(rows)
    return bins * max(spans) * (prefix + max(spans))


def counts(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor, micro: int, shared: bool) -> dict[str, int]:
    """Token positions padded / packed / distinct and attention pairs padded / packed of one record's kept rows."""
    order = row_order(ids, attn, resp, micro, shared).tolist()
    first, labels = prefix_groups(ids, resp)
    first, lengths = first.tolist(), attn.sum(1).tolist()
    if not shared:
        labels = [-1 - i for i in range(len(labels))]
    prefixes = {label: f for label, f in zip(labels, first, strict=True) if label >= 0}
    distinct = sum(prefixes.values()) + sum(n - (f if label >= 0 else 0)
                                            for n, f, label in zip(lengths, first, labels, strict=True))
    chunks = [order[start:start + micro] for start in range(0, len(order), micro)]
    return {"padded": _forwarded_tokens(order, lengths, first, labels, micro, pack=False),
            "packed": _forwarded_tokens(order, lengths, first, labels, micro, pack=True), "distinct": distinct,
            **{f"pairs_{kind}": sum(attention_pairs(c, lengths, first, labels, kind == "packed") for c in chunks)
               for kind in ("padded", "packed")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    print("| run | steps | rows | padded | packed | distinct | padded share, padded | padded share, packed "
          "| packed / padded | attention, packed / padded |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in args.runs:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        micro, shared = cfg["train"]["micro_batch_size"], cfg["train"]["shared_prefix"]
        totals: dict[str, int] = {}
        steps = rows = 0
        for path in records(run):
            tensors = kept(RecordedStep.read(path))
            for key, value in counts(*tensors, micro, shared).items():
                totals[key] = totals.get(key, 0) + value
            steps, rows = steps + 1, rows + len(tensors[0])
        padded, packed, distinct = totals["padded"], totals["packed"], totals["distinct"]
        print(f"| {run.name} | {steps} | {rows} | {padded} | {packed} | {distinct} | {1 - distinct / padded:.1%} "
              f"| {1 - distinct / packed:.1%} | {packed / padded:.3f} "
              f"| {totals['pairs_packed'] / totals['pairs_padded']:.3f} |")


if __name__ == "__main__":
    main()
