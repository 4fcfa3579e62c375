"""One rank of the 2-process probe test (`tests/test_probe.py::test_probe_over_two_ranks_equals_one_process`).

Run under torchrun: every rank builds the same model and batch, wraps the model (replicas, or FSDP2 shards),
probes the whole batch and writes its metrics and sketches to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import sys

import torch

from rldynamics import dist
from rldynamics.analysis.probe import ProbeSettings, gradient_probe
from rldynamics.models.sharding import wrap
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from test_probe import DIST_CASES, algo_cfg, components_of, make_batch, sokoban_corpus


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_from_env()
    results = {}
    for shard in (False, True):
        tokenizer = build_tiny_tokenizer(sokoban_corpus())
        model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, intermediate_size=64)
        batch, inputs, stds = make_batch(model)
        model = wrap(model, shard)
        for case, (mode, kwargs) in DIST_CASES.items():
            result = gradient_probe(model, batch, inputs, stds, ProbeSettings(algo=algo_cfg(mode), temperature=1.0,
                                                                              **kwargs),
                                    component_advantages=components_of(batch) if "components" in case else None)
            results[f"{case}/shard={shard}"] = {"metrics": result.metrics,
                                                "sketches": {k: v.tolist() for k, v in result.sketches.items()},
                                                "group_norms": {str(g): v for g, v in result.group_norms.items()}}
            assert all(p.grad is None for p in model.parameters()), ".grad must be left as found"
    with open(f"{out_dir}/rank{dist.rank()}.json", "w") as f:
        json.dump(results, f)
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1])
