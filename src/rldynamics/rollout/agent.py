"""The multi-turn agent loop: envs in groups, batched generation, action parsing, one sequence per trajectory.

Design choices:
- Token ids are built incrementally, ChatML segment by segment, and the model's sampled ids are appended
  as they are: the tokens trained on are the tokens sampled (no re-tokenisation of reformatted text).
- A group's envs share one seed (same initial state). Turn reward = sum of env step rewards plus the
  format penalty when the response is malformed; trajectory reward = sum of turn rewards, placed on the
  last sampled token (`RolloutBatch.token_rewards`).
- Generation uses the HF `generate` API (any causal LM); sampling is seeded by the caller through
  `torch.manual_seed`, so a rollout is a pure function of (model, seeds, sampling seed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rldynamics.config import EnvConfig
from rldynamics.envs import make_env
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.rollout.parse import parse_response
from rldynamics.rollout.sampling import sampling_guard

SYSTEM_PREFIX = "You're a helpful assistant. "
INVALID_NOTE = "No valid action provided previously. Environment state remains the same. Please try again.\n"


def env_kwargs(cfg: EnvConfig) -> dict:
    """The env-specific constructor arguments of `cfg` (Sokoban's keys for now)."""
    return {
        "dim_room": tuple(cfg.dim_room),
        "num_boxes": cfg.num_boxes,
        "max_steps": cfg.max_steps,
        "search_depth": cfg.search_depth,
        "observation_format": cfg.observation_format,
        "step_penalty": cfg.step_penalty,
    }


def format_hint(cfg: EnvConfig) -> str:
    """The output-format instruction of the system prompt."""
    body = "<think> [your thoughts] </think> <answer> [your answer] </answer>" if cfg.enable_think else (
        "<answer> [your answer] </answer>"
    )
    return f"Always output: {body} with no extra text. Max response length: {cfg.max_new_tokens} tokens."


def system_message(instructions: str, cfg: EnvConfig) -> str:
    """The system prompt: the env's instructions, the action budget and the output format."""
    return (f"{SYSTEM_PREFIX}{instructions}\nUp to {cfg.max_actions_per_turn} actions per turn, separated by "
            f"\" || \". {format_hint(cfg)}")


def state_message(turn: int, observation: str, actions_left: int) -> str:
    """The user message that shows the state at the start of a turn."""
    return f"Turn {turn}:\nState:\n{observation}\nYou have {actions_left} actions left."


def chat_segment(role: str, content: str) -> str:
    """One complete ChatML message."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def assistant_header(cfg: EnvConfig) -> str:
    """The generation prompt that opens the assistant's turn."""
    return "<|im_start|>assistant\n" + ("<think>" if cfg.enable_think else "")


@dataclass
class Trajectory:
    """Mutable state of one trajectory during the rollout."""

    env: object
    seed: int
    group_id: int
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    num_actions: int = 0
    turns: int = 0
    valid_turns: int = 0
    effective_actions: int = 0
    response_tokens: int = 0
    observation: str = ""

    def add(self, ids: list[int], sampled: bool) -> None:
        self.ids += ids
        self.sampled += [sampled] * len(ids)


def rollout(model, tokenizer, seeds: list[int], group_size: int, cfg: EnvConfig, *, temperature: float = 1.0,
            respond: Callable[[list[Trajectory]], list[list[int]]] | None = None) -> RolloutBatch:
    """Run `len(seeds)` groups of `group_size` envs for up to `cfg.max_turns` turns; return their batch.

    Args:
        model: an HF causal LM (in eval mode for generation).
        tokenizer: its tokenizer; must know `<|im_start|>` / `<|im_end|>` (ChatML).
        seeds: one env seed per group.
        temperature: sampling temperature.
        respond: optional policy replacing the model: maps the active trajectories to response token ids
            (each ending with `<|im_end|>`); used for scripted demonstrations.
    """
    encode = _encoder(tokenizer)
    trajs = []
    for g, seed in enumerate(seeds):
        for _ in range(group_size):
            env = make_env(cfg.name, **env_kwargs(cfg))
            traj = Trajectory(env=env, seed=seed, group_id=g)
            observation = traj.observation = env.reset(seed)
            system = chat_segment("system", system_message(env.instructions(), cfg))
            user = chat_segment("user", state_message(1, observation, cfg.max_actions_per_traj))
            traj.add(encode(system + user + assistant_header(cfg)), sampled=False)
            trajs.append(traj)
    for turn in range(1, cfg.max_turns + 1):
        active = [t for t in trajs if not t.done]
        if not active:
            break
        if respond is None:
            responses = generate(model, tokenizer, [t.ids for t in active], cfg.max_new_tokens, temperature)
        else:
            responses = respond(active)
        for traj, response in zip(active, responses, strict=True):
            _play_turn(traj, response, turn, tokenizer, encode, cfg)
    return _to_batch(trajs, tokenizer)


def _encoder(tokenizer):
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return encode


def _play_turn(traj: Trajectory, response: list[int], turn: int, tokenizer, encode, cfg: EnvConfig) -> None:
    """Append the sampled response, execute its actions, append the next user message (or close)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    traj.add(response, sampled=True)
    traj.response_tokens += len(response)
    if not response or response[-1] != eos:
        traj.add([eos], sampled=False)  # close a truncated message; not trained
    text = tokenizer.decode(response, skip_special_tokens=True)
    parsed = parse_response(text, traj.env.actions, max_actions=cfg.max_actions_per_turn,
                            enable_think=cfg.enable_think)
    turn_reward = 0.0 if parsed.format_ok else cfg.format_penalty
    traj.turns += 1
    traj.valid_turns += int(bool(parsed.actions))
    for action in parsed.actions[: cfg.max_actions_per_traj - traj.num_actions]:
        result = traj.env.step(action)
        traj.num_actions += 1
        traj.effective_actions += int(result.info.get("action_is_effective", 0))
        turn_reward += result.reward
        traj.observation = result.observation
        if result.done:
            traj.done = True
            break
    traj.reward += turn_reward
    if traj.num_actions >= cfg.max_actions_per_traj or turn == cfg.max_turns or traj.env.success():
        traj.done = True
    if not traj.done:
        note = "" if parsed.actions else INVALID_NOTE
        actions_left = cfg.max_actions_per_traj - traj.num_actions
        user = f"Reward: {turn_reward:g}\n{note}" + state_message(turn + 1, traj.observation, actions_left)
        traj.add(encode("\n" + chat_segment("user", user) + assistant_header(cfg)), sampled=False)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
    """Sample one response per prompt (left-padded batch); each response ends at its first `<|im_end|>`."""
    pad = tokenizer.pad_token_id
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, W]
    attention = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, W]
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=True,
        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
        logits_processor=sampling_guard(temperature),  # applies the temperature; raises NonFiniteLogits
    )  # [B, W + new]
    responses = []
    for row in out[:, width:].tolist():
        cut = row.index(eos) + 1 if eos in row else len(row)
        responses.append(row[:cut])
    return responses


def _to_batch(trajs: list[Trajectory], tokenizer) -> RolloutBatch:
    """Right-pad the trajectories into a RolloutBatch with per-trajectory env metrics."""
    width = max(len(t.ids) for t in trajs)
    n = len(trajs)
    input_ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)  # [N, L]
    attention = torch.zeros(n, width, dtype=torch.long)  # [N, L]
    response_mask = torch.zeros(n, width)  # [N, L]
    for i, t in enumerate(trajs):
        input_ids[i, : len(t.ids)] = torch.tensor(t.ids)
        attention[i, : len(t.ids)] = 1
        response_mask[i, : len(t.ids)] = torch.tensor(t.sampled, dtype=torch.float32)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response_mask,
        scores=torch.tensor([t.reward for t in trajs], dtype=torch.float32),  # [N]
        group_ids=torch.tensor([t.group_id for t in trajs], dtype=torch.long),  # [N]
        env_metrics=[_metrics(t) for t in trajs],
        texts=[tokenizer.decode(t.ids, skip_special_tokens=False) for t in trajs],
        seeds=[t.seed for t in trajs],
    )


def _metrics(t: Trajectory) -> dict[str, float]:
    return {
        "success": float(t.env.success()),
        "num_actions": float(t.num_actions),
        "action_is_effective": t.effective_actions / max(t.num_actions, 1),
        "action_is_valid": t.valid_turns / max(t.turns, 1),
        "manager_invalid_action": 1.0 - t.valid_turns / max(t.turns, 1),
        "response_length": t.response_tokens / max(t.turns, 1),
        "num_turns": float(t.turns),
        "reward": t.reward,
    }


def env_metric_summary(batch: RolloutBatch, prefix: str, group_size: int) -> dict[str, float]:
    """Mean of each per-trajectory env metric as `<prefix>/<name>`, plus pass@group_size."""
    if not batch.env_metrics:
        return {}
    out = {f"{prefix}/{k}": sum(m[k] for m in batch.env_metrics) / len(batch) for k in batch.env_metrics[0]}
    groups = batch.group_rows()
    passed = [max(batch.env_metrics[i]["success"] for i in rows) for rows in groups.values()]
    out[f"{prefix}/pass@{group_size}"] = sum(passed) / len(passed)
    return out
