"""RolloutBatch: the trajectories of one rollout as padded tensors, one row per trajectory.

Conventions (one place for shapes):
- Every per-token tensor is aligned with `input_ids` positions: `[N, L]`, where entry `t` describes
  token `t` as predicted from the prefix `< t` (so column 0 never carries a log-prob or a loss).
- `response_mask[i, t] = 1` iff token `t` of trajectory `i` was sampled by the model. The trained
  tokens are exactly the sampled tokens; chat-template and observation tokens have mask 0.
- Rows are right-padded with the tokenizer's pad id (attention 0); trajectories of a group are
  contiguous and share `group_ids`.
- `rollout_logprobs[i, t]` is the log-prob the rollout engine sampled token `t` with (temperature applied;
  0 where the mask is 0): compared with the trainer's old log-probs it measures the sampler/trainer mismatch.
- Rewards are named: `reward_components[i, k]` is the raw value of component `reward_names[k]` summed
  over trajectory `i`'s turns; `scores` is the trained reward, Σ_k reward_weights[k] · component k
  (formed once, in `rollout.rewards.weighted_sum`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

PER_TOKEN = ("input_ids", "attention_mask", "response_mask", "rollout_logprobs")  # the [N, L] fields


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [N, L] long, right-padded
    attention_mask: torch.Tensor  # [N, L] long
    response_mask: torch.Tensor  # [N, L] float {0,1}: token sampled by the model
    scores: torch.Tensor  # [N] float: trained trajectory reward (weighted sum of the components)
    group_ids: torch.Tensor  # [N] long: trajectories of a group share an initial state
    reward_components: torch.Tensor | None = None  # [N, K] float: raw reward components per trajectory
    reward_names: tuple[str, ...] = ()  # K component names (batch-level, not per row)
    reward_weights: tuple[float, ...] = ()  # K weights of the trained score (batch-level)
    env_metrics: list[dict[str, float]] = field(default_factory=list)  # one dict per trajectory
    rollout_logprobs: torch.Tensor | None = None  # [N, L] float: the sampler's log-prob of each sampled token
    texts: list[str] = field(default_factory=list)  # decoded conversation per trajectory
    seeds: list[int] = field(default_factory=list)  # env seed per trajectory

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def token_rewards(self) -> torch.Tensor:
        """The trajectory reward placed on the last sampled token of each row, zero elsewhere. [N, L]"""
        return self.last_token(self.scores)

    def last_token(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row `values` [N] placed on the last sampled token of each row, zero elsewhere. [N, L]"""
        n, length = self.response_mask.shape
        positions = torch.arange(length).expand(n, length)  # [N, L]
        last = torch.where(self.response_mask > 0, positions, -1).amax(dim=1)  # [N]
        out = torch.zeros(n, length, dtype=torch.float32)  # [N, L]
        has = last >= 0  # [N]
        out[has.nonzero().squeeze(1), last[has]] = values[has].float()
        return out

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        """A new batch holding `rows` (in the given order); per-token tensors keep their width L."""
        rows = torch.as_tensor(rows, dtype=torch.long)  # [M]
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value[rows]
            elif isinstance(value, list):
                picked[f.name] = [value[i] for i in rows.tolist()] if value else []
        return replace(self, **picked)

    @staticmethod
    def concat(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
        """The rows of `parts` one after another (a rollout gathered from ranks); per-token tensors are right-padded
        (`pad_id`, attention and masks 0) to the widest part. The batch-level fields are those of the first part."""
        width = max(p.input_ids.shape[1] for p in parts)
        joined = {}
        for f in fields(RolloutBatch):
            values = [getattr(p, f.name) for p in parts]
            if f.name in PER_TOKEN and any(v is None for v in values):
                joined[f.name] = None
            elif f.name in PER_TOKEN:
                pad = pad_id if f.name == "input_ids" else 0
                joined[f.name] = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1]), value=pad)
                                            for v in values])  # [N, width]
            elif isinstance(values[0], torch.Tensor):
                joined[f.name] = torch.cat(values)
            elif isinstance(values[0], list):
                joined[f.name] = [x for v in values for x in v]
        return replace(parts[0], **joined)

    def group_rows(self) -> dict[int, list[int]]:
        """Row indices of each group id, in order of first appearance."""
        rows: dict[int, list[int]] = {}
        for i, g in enumerate(self.group_ids.tolist()):
            rows.setdefault(g, []).append(i)
        return rows

    def group_matrix(self) -> tuple[list[int], torch.Tensor]:
        """Group ids and their trajectory scores as a [G, n] matrix (groups must be of equal size)."""
        rows = self.group_rows()
        sizes = {len(r) for r in rows.values()}
        if len(sizes) > 1:
            raise ValueError(f"groups have unequal sizes {sorted(sizes)}; filtering needs equal group sizes")
        ids = list(rows)
        matrix = torch.stack([self.scores[r] for r in rows.values()]) if rows else torch.zeros(0, 0)  # [G, n]
        return ids, matrix.float()
