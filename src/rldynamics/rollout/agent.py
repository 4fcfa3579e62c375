"""The multi-turn agent loop: envs in groups, batched generation, action parsing, one sequence per trajectory.

Design choices:
- Prompts come from the tokenizer's chat template, rendered turn by turn (`rollout.chat`), and the
  model's sampled ids are appended as they are: the tokens trained on are the tokens sampled (no
  re-tokenisation of reformatted text).
- A group's envs share one seed (same initial state). Rewards stay named components until the end: each
  env step reports its components, a malformed turn adds `format_penalty` (when non-zero); the trajectory's
  components are summed over turns, the user's reward functions (`env.reward_funcs`, `envs.reward_funcs`) add theirs
  once the episodes are over, and the trained score is their weighted sum (`rollout.rewards.weighted_sum`), placed
  on the last sampled token (`RolloutBatch.token_rewards`).
- Generation goes through a rollout engine (`rollout.engines.RolloutEngine`, chosen by `rollout.engine` from
  `rollout.engines.ENGINES`): `HFEngine` (the default, HF `generate`, any causal LM) or the colocated vLLM engine
  (`rollout.vllm_engine`, `rollout.engine=vllm`). The HF engine's rollout runs the model's large float32 linears
  through weights packed once for it (`models.packed`). Both take token ids in and give the sampled ids and the
  sampler's log-prob of each (temperature applied) out; the batch keeps those log-probs
  (`RolloutBatch.rollout_logprobs`) so the sampler/trainer mismatch can be measured (`algo.rollout_corr`).
- With the HF engine sampling is seeded by the caller through
  `torch.manual_seed`, so a rollout is a pure function of (model, seeds, sampling seed). With `row_seed` each
  trajectory samples from its own keyed stream instead (`rollout.sampling.RowSeededNoise`, keyed on
  (row_seed, global row, turn)), so a trajectory does not depend on the other rows of the batch: a rollout of
  groups `first_group ...` is then the corresponding part of the rollout of all groups.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from rldynamics import metric_names
from rldynamics.config import EnvConfig
from rldynamics.envs import make_env
from rldynamics.envs.reward_funcs import ERRORS, load_reward_funcs, score
from rldynamics.models.forward import caches_plainly, with_cache
from rldynamics.models.packed import packed_linears
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.rollout.chat import ChatPrompts, Conversation
from rldynamics.rollout.engines import RolloutEngine
from rldynamics.rollout.parse import ParsedTurn, parse_answer, parse_response
from rldynamics.rollout.prefill import TurnCaches, shared_prompt_cache, with_room
from rldynamics.rollout.rewards import resolve_weights, reward_names, weighted_sum
from rldynamics.rollout.sampling import SampledLogprobs, row_key, sampling_processors

SYSTEM_PREFIX = "You're a helpful assistant. "
INVALID_NOTE = "No valid action provided previously. Environment state remains the same. Please try again.\n"


def format_hint(cfg: EnvConfig) -> str:
    """The output-format instruction of the system prompt."""
    body = "<think> [your thoughts] </think> <answer> [your answer] </answer>" if cfg.enable_think else (
        "<answer> [your answer] </answer>"
    )
    return f"Always output: {body} with no extra text. Max response length: {cfg.max_new_tokens} tokens."


def system_message(env, cfg: EnvConfig) -> str:
    """The system prompt: the env's instructions, the action budget (action-word envs) and the output format."""
    budget = (f"Up to {cfg.max_actions_per_turn} actions per turn, separated by \" || \". " if env.actions else "")
    return f"{SYSTEM_PREFIX}{env.instructions()}\n{budget}{format_hint(cfg)}"


def state_message(env, turn: int, observation: str, actions_left: int) -> str:
    """The user message that shows the state at the start of a turn."""
    text = f"Turn {turn}:\nState:\n{observation}"
    return text + (f"\nYou have {actions_left} actions left." if env.actions else "")


def next_user_message(env, turn: int, observation: str, actions_left: int, reward: float, *, valid: bool) -> str:
    """The user message before `turn` (> 1): the last turn's reward, the invalid-action note when its reply named no
    valid action, and the state."""
    note = "" if valid else INVALID_NOTE
    return f"Reward: {reward:g}\n{note}" + state_message(env, turn, observation, actions_left)


@dataclass
class Trajectory:
    """Mutable state of one trajectory during the rollout."""

    env: object
    seed: int
    group_id: int
    row: int  # global row index: group_id * group_size + member
    conversation: Conversation
    rewards: dict[str, float]
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampler's log-prob of each token (0 if not sampled)
    done: bool = False
    num_actions: int = 0
    turns: int = 0
    valid_turns: int = 0
    effective_actions: int = 0
    response_tokens: int = 0
    observation: str = ""
    prompt: str = ""  # the first observation (a data set's prompt)
    replies: list[str] = field(default_factory=list)  # each turn's decoded reply
    func_errors: int | None = None  # reward functions that failed on this trajectory (None: no reward functions)

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.sampled += [sampled] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@dataclass
class RolloutContext:
    """What every turn of a rollout needs besides the trajectory: config, prompts, encoder, reward weights."""

    cfg: EnvConfig
    chat: ChatPrompts
    tokenizer: object
    weights: dict[str, float]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def rollout(model, tokenizer, seeds: list[int], group_size: int, cfg: EnvConfig, *, temperature: float = 1.0,
            respond: Callable[[list[Trajectory]], list[list[int]]] | None = None, row_seed: int | None = None,
            first_group: int = 0, engine: RolloutEngine | None = None) -> RolloutBatch:
    """Run `len(seeds)` groups of `group_size` envs for up to `cfg.max_turns` turns; return their batch.

    Args:
        model: an HF causal LM (in eval mode for generation).
        tokenizer: its tokenizer, with a chat template.
        seeds: one env seed per group.
        temperature: sampling temperature.
        respond: optional policy replacing the model: maps the active trajectories to response token ids
            (each ending with a stop token); used for scripted demonstrations.
        row_seed: None = sample from the global torch RNG (seeded by the caller); an int = every trajectory
            samples from its own stream keyed on (row_seed, global row, turn).
        first_group: group id of the first group (a shard of a larger rollout); global rows follow from it.
        engine: the run's rollout engine (`RolloutEngine`: its `generate` each turn, its `drop` for each finished
            trajectory); None = a fresh `HFEngine` on `model`.
    """
    chat = ChatPrompts(tokenizer, enable_think=cfg.enable_think, open_answer=cfg.open_answer, model=model)
    probe_env = make_env(cfg.name, **cfg.options())
    names = reward_names(probe_env, cfg)
    ctx = RolloutContext(cfg=cfg, chat=chat, tokenizer=tokenizer, weights=resolve_weights(probe_env, cfg, names))
    trajs = [_start(ctx, seed, first_group + g, (first_group + g) * group_size + j, names)
             for g, seed in enumerate(seeds) for j in range(group_size)]
    packing = nullcontext()
    if respond is None and engine is None:
        engine = HFEngine(model, tokenizer)  # per rollout: its turn caches live as long as the rollout
        packing = packed_linears(model, len(trajs))  # the weights stay fixed for the rollout: packed once
    scope = getattr(probe_env, "rollout_scope", None)  # optional Env hook (envs/base.py)
    with scope() if scope is not None else nullcontext(), packing:
        for turn in range(1, cfg.max_turns + 1):
            active = [i for i, t in enumerate(trajs) if not t.done]
            if not active:
                break
            if respond is None:
                keys = None if row_seed is None else [row_key(row_seed, trajs[i].row, turn) for i in active]
                responses, logprobs = engine.generate([trajs[i].ids for i in active], cfg.max_new_tokens,
                                                      temperature, chat.stop_ids, row_keys=keys, cache_keys=active)
            else:
                responses, logprobs = respond([trajs[i] for i in active]), [None] * len(active)
            for i, response, sampled_logprobs in zip(active, responses, logprobs, strict=True):
                _play_turn(ctx, trajs[i], response, turn, sampled_logprobs)
                if trajs[i].done and engine is not None:
                    engine.drop(i)
    _apply_reward_funcs(load_reward_funcs(cfg.reward_funcs), trajs, ctx.weights)
    return _to_batch(trajs, tokenizer, names, ctx.weights)


def _apply_reward_funcs(funcs: list, trajs: list[Trajectory], weights: dict[str, float]) -> None:
    """Add the user's reward functions' components (`env.reward_funcs`, called on the whole rollout, TRL's way) to
    every trajectory, count the functions that failed on it, and tell envs with the `graded` hook their reward."""
    if not funcs:
        return
    graded = score(funcs, [t.prompt for t in trajs], [t.replies[-1] if t.replies else "" for t in trajs],
                   [t.env.columns() if hasattr(t.env, "columns") else {} for t in trajs],
                   [_location(t) for t in trajs], lambda line: print(line, file=sys.stderr))
    for i, t in enumerate(trajs):
        for name, values in graded.values.items():
            t.rewards[name] += values[i]
        t.func_errors = graded.errors[i]
        hook = getattr(t.env, "graded", None)  # optional Env hook (envs/base.py)
        if hook is not None:
            hook(weighted_sum(t.rewards, weights))


def _location(t: Trajectory) -> str:
    where = t.env.location() if hasattr(t.env, "location") else ""
    return f"{where} (env seed {t.seed})" if where else f"env seed {t.seed}"


def _start(ctx: RolloutContext, seed: int, group_id: int, row: int, names: tuple[str, ...]) -> Trajectory:
    """A fresh env reset to `seed` and the token ids of its first prompt."""
    env = make_env(ctx.cfg.name, **ctx.cfg.options())
    observation = env.reset(seed)
    conversation, prompt = ctx.chat.start(system_message(env, ctx.cfg),
                                          state_message(env, 1, observation, ctx.cfg.max_actions_per_traj))
    traj = Trajectory(env=env, seed=seed, group_id=group_id, row=row, conversation=conversation,
                      rewards=dict.fromkeys(names, 0.0), observation=observation, prompt=observation)
    traj.add(ctx.encode(prompt), sampled=False)
    return traj


def trajectory_tokens(cfg: EnvConfig, tokenizer, seeds: range = range(16)) -> tuple[int, int]:
    """Tokens of the longest first prompt of the env's `seeds` in the tokenizer's chat template, and an estimate of
    the longest whole trajectory: such a prompt, a reply of `max_new_tokens` per turn and, before each further turn,
    what `_play_turn` appends (the end of the turn, a user message with the reward, the invalid-action note and a
    state message like the first, the generation prompt), and the tokens closing a cut last reply. For sizing memory
    before a run (a dataset's prompts differ in length); real states may be longer or shorter."""
    chat = ChatPrompts(tokenizer, enable_think=cfg.enable_think, open_answer=cfg.open_answer)
    closing = len(chat.closing_ids())  # a reply cut at max_new_tokens is closed

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    env = make_env(cfg.name, **cfg.options())

    def of(seed: int) -> tuple[int, int]:
        observation = env.reset(seed)
        conversation, prompt = chat.start(system_message(env, cfg),
                                          state_message(env, 1, observation, cfg.max_actions_per_traj))
        user = next_user_message(env, 2, observation, cfg.max_actions_per_traj, -1.0, valid=False)
        following = count(chat.next_turn(conversation, user)) if cfg.max_turns > 1 else 0
        first = count(prompt)
        return first, first + cfg.max_turns * cfg.max_new_tokens + (cfg.max_turns - 1) * following + closing

    sizes = [of(seed) for seed in seeds]
    return max(first for first, _ in sizes), max(whole for _, whole in sizes)


def _play_turn(ctx: RolloutContext, traj: Trajectory, response: list[int], turn: int,
               logprobs: list[float] | None = None) -> None:
    """Append the sampled response (and its sampling log-probs), execute its actions, append the next user message
    (or close the turn)."""
    cfg, chat = ctx.cfg, ctx.chat
    traj.add(response, sampled=True, logprobs=logprobs)
    traj.response_tokens += len(response)
    stopped = bool(response) and response[-1] in chat.stop_ids
    text = chat.reply_prefix + ctx.tokenizer.decode(response, skip_special_tokens=True)
    traj.replies.append(text)
    env = traj.env
    full_reply = getattr(env, "full_reply", False)
    if full_reply:  # the env grades the whole reply itself (Env protocol, envs/base.py)
        parsed = ParsedTurn(actions=[text], format_ok=True)
    elif env.actions:
        parsed = parse_response(text, env.actions, max_actions=cfg.max_actions_per_turn, enable_think=cfg.enable_think,
                                answer_only=cfg.answer_only)
    else:
        parsed = parse_answer(text, enable_think=cfg.enable_think, answer_only=cfg.answer_only)
    turn_rewards = dict.fromkeys(traj.rewards, 0.0)
    if not parsed.format_ok and "format_penalty" in turn_rewards:
        turn_rewards["format_penalty"] = cfg.format_penalty
    traj.turns += 1
    traj.valid_turns += int(bool(parsed.actions))
    for action in parsed.actions[: cfg.max_actions_per_traj - traj.num_actions]:
        result = env.step(action, num_tokens=len(response)) if full_reply else env.step(action)
        traj.num_actions += 1
        traj.effective_actions += int(result.info.get("action_is_effective", 0))
        for name, value in result.reward.items():
            turn_rewards[name] += value
        traj.observation = result.observation
        if result.done:
            traj.done = True
            break
    for name, value in turn_rewards.items():
        traj.rewards[name] += value
    if traj.num_actions >= cfg.max_actions_per_traj or turn == cfg.max_turns or env.success():
        traj.done = True
    if traj.done:
        if not stopped:
            traj.add(chat.closing_ids(), sampled=False)  # close a truncated reply; not trained
        return
    user = next_user_message(env, turn + 1, traj.observation, cfg.max_actions_per_traj - traj.num_actions,
                             weighted_sum(turn_rewards, ctx.weights), valid=bool(parsed.actions))
    following = chat.next_turn(traj.conversation, user)
    closing = chat.end_of_turn.rstrip()
    if stopped and following.startswith(closing) and ctx.tokenizer.decode(response[-1:]) == closing:
        following = following[len(closing):]  # the sampled stop token already closed the turn
    traj.add(ctx.encode(following), sampled=False)


class HFEngine:
    """The HF `generate` rollout engine of one rollout: `generate_with_logprobs` with the rollout's turn caches."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.caches = TurnCaches(model)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, stop_ids: list[int], *,
                 row_keys: list[int] | None = None,
                 cache_keys: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        return generate_with_logprobs(self.model, self.tokenizer, prompts, max_new_tokens, temperature, stop_ids,
                                      row_keys, caches=self.caches, cache_keys=cache_keys)

    def drop(self, key: int) -> None:
        """Forget the cache of a finished trajectory."""
        self.caches.drop(key)

    def sync(self, model: torch.nn.Module) -> None:
        """Nothing to load: the engine generates with the trainer's model itself."""

    def release(self) -> None:
        """Nothing to free: the turn caches go with the engine when its rollout ends."""


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
             stop_ids: list[int], row_keys: list[int] | None = None, *, caches: TurnCaches | None = None,
             cache_keys: list[int] | None = None) -> list[list[int]]:
    """The responses of `generate_with_logprobs` alone."""
    return generate_with_logprobs(model, tokenizer, prompts, max_new_tokens, temperature, stop_ids, row_keys,
                                  caches=caches, cache_keys=cache_keys)[0]


@torch.no_grad()
def generate_with_logprobs(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                           stop_ids: list[int], row_keys: list[int] | None = None, *,
                           caches: TurnCaches | None = None,
                           cache_keys: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one response per prompt (left-padded batch); each response ends at its first stop id (kept).
    Also returns the sampler's log-prob of each sampled token, log softmax(logits / temperature), as sampled from.

    `row_keys` (one per prompt): each row samples from its own keyed stream (`rollout.sampling`) instead of
    the global torch RNG. With `caches` (and one trajectory key per prompt in `cache_keys`), the tokens each
    prompt shares with its trajectory's earlier turns come from its cache and the cache is updated with this
    turn's tokens; otherwise a prompt shared by several rows is prefilled once (`shared_prompt_cache`).
    """
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, W]
    attention = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, W]
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    device = next(model.parameters()).device
    input_ids, attention = input_ids.to(device), attention.to(device)
    cache = caches.batch_cache(cache_keys, prompts) if caches is not None and caches.rows else None
    if cache is None:
        cache = shared_prompt_cache(model, input_ids, attention)  # a group's shared prompt is encoded once
    if cache is None and caches_plainly(model):
        cache = DynamicCache(config=model.config)  # filled by generate (and with `caches` kept for the next turn)
    if cache is not None:
        with_room(cache, max_new_tokens)  # a decode step writes its keys and values; nothing is concatenated
    recorder = SampledLogprobs()
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, temperature=1.0, max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids, pad_token_id=pad, logits_processor=sampling_processors(temperature, row_keys, recorder),
        do_sample=False,
        **with_cache(model, cache),
    )  # [B, W + new]: the guard applies the temperature, the last processor samples, and greedy takes its token
    sampled_logprobs = recorder.finish(out).tolist()  # [B, new]
    stops = set(stop_ids)
    responses, logprobs = [], []
    for row, row_logprobs in zip(out[:, width:].tolist(), sampled_logprobs, strict=True):
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        responses.append(row[:cut])
        logprobs.append(row_logprobs[:cut])
    if caches is not None:
        caches.keep(cache, cache_keys, prompts, responses)
    return responses, logprobs


def _to_batch(trajs: list[Trajectory], tokenizer, names: tuple[str, ...], weights: dict[str, float]) -> RolloutBatch:
    """Right-pad the trajectories into a RolloutBatch with reward components and per-trajectory env metrics."""
    width = max(len(t.ids) for t in trajs)
    n = len(trajs)
    input_ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)  # [N, L]
    attention = torch.zeros(n, width, dtype=torch.long)  # [N, L]
    response_mask = torch.zeros(n, width)  # [N, L]
    rollout_logprobs = torch.zeros(n, width)  # [N, L]
    for i, t in enumerate(trajs):
        input_ids[i, : len(t.ids)] = torch.tensor(t.ids)
        attention[i, : len(t.ids)] = 1
        response_mask[i, : len(t.ids)] = torch.tensor(t.sampled, dtype=torch.float32)
        rollout_logprobs[i, : len(t.ids)] = torch.tensor(t.logprobs, dtype=torch.float32)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        scores=torch.tensor([weighted_sum(t.rewards, weights) for t in trajs], dtype=torch.float32),  # [N]
        group_ids=torch.tensor([t.group_id for t in trajs], dtype=torch.long),  # [N]
        reward_components=torch.tensor([[t.rewards[k] for k in names] for t in trajs], dtype=torch.float32),  # [N, K]
        reward_names=names,
        reward_weights=tuple(weights[k] for k in names),
        env_metrics=[_metrics(t, weights) for t in trajs],
        texts=[tokenizer.decode(t.ids, skip_special_tokens=False) for t in trajs],
        seeds=[t.seed for t in trajs],
    )


def _metrics(t: Trajectory, weights: dict[str, float]) -> dict[str, float]:
    extra = getattr(t.env, "metrics", None)  # optional Env hook (envs/base.py)
    return {
        metric_names.SUCCESS: float(t.env.success()),
        "num_actions": float(t.num_actions),
        "action_is_effective": t.effective_actions / max(t.num_actions, 1),
        "action_is_valid": t.valid_turns / max(t.turns, 1),
        "manager_invalid_action": 1.0 - t.valid_turns / max(t.turns, 1),
        "response_length": t.response_tokens / max(t.turns, 1),
        "num_turns": float(t.turns),
        "reward": weighted_sum(t.rewards, weights),
        **({ERRORS: float(t.func_errors)} if t.func_errors is not None else {}),
        **(extra() if extra is not None else {}),
    }


def env_metric_summary(batch: RolloutBatch, prefix: str, group_size: int) -> dict[str, float]:
    """Mean of each per-trajectory env metric as `<prefix>/<name>`, plus pass@group_size."""
    if not batch.env_metrics:
        return {}
    out = {f"{prefix}/{k}": sum(m[k] for m in batch.env_metrics) / len(batch) for k in batch.env_metrics[0]}
    groups = batch.group_rows()
    passed = [max(batch.env_metrics[i][metric_names.SUCCESS] for i in rows) for rows in groups.values()]
    out[f"{prefix}/pass@{group_size}"] = sum(passed) / len(passed)
    return out
