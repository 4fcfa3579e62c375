"""One rank of the 2-process trace test (`tests/test_update_trace.py::test_two_ranks_trace_like_one_process`).

Run under torchrun: every rank builds the same model and batch, wraps the model (replicas, or FSDP2 shards), runs
one traced actor update (plain SGD, a guard refusing the 2nd step) and writes its step traces to OUT/rank<r>.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from rldynamics import dist
from rldynamics.models.sharding import wrap
from test_probe import make_batch
from test_update_trace import WORKER_OVERRIDES, run, second_refused, tiny_model


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_from_env()
    results = {}
    for shard in (False, True):
        model = tiny_model()
        data = make_batch(model)
        model = wrap(model, shard)
        _, update, _ = run(model, data, WORKER_OVERRIDES, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           trace_groups=True, guard=second_refused())
        results[str(shard)] = [dataclasses.asdict(step) for step in update.steps]
    with open(f"{out_dir}/rank{dist.rank()}.json", "w") as f:
        json.dump(results, f)
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1])
