"""What `rldyn sft` trains on: conversations as token ids with the assistant's tokens marked, and their packing.

Two sources give the same `Conversation`:
- an env's own solver playing episodes through the agent loop (`from_rollout` of `rollout(..., respond=...)`): the
  exact multi-turn chat the env plays, in the model's chat template, the replies marked as the rollout marks sampled
  tokens (`RolloutBatch.response_mask`);
- a user's data set in TRL's conversational format (`from_messages`): rows with a `messages` list of
  {role, content}, written with the tokenizer's chat template. An assistant message's tokens are those the template
  adds after the conversation up to it with the generation prompt (`add_generation_prompt=True`): its content and
  the template's closing tokens, never the opener the prompt already ends with.

Packing (`pack`, `packed_tensors`) puts whole conversations one after another into rows of `max_length` tokens
(first fit, longest first), each with position ids from 0, so `models.forward.packed_logprobs` attends within a
conversation only and no row computes padding beyond its tail.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from rldynamics.config import Config, EnvConfig
from rldynamics.envs.base import random_action
from rldynamics.envs.data_source import read_rows
from rldynamics.envs.split import env_first_observation, problem_key
from rldynamics.models.forward import pack_segments
from rldynamics.rollout.agent import rollout
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.rollout.chat import ChatPrompts

ROLES = ("system", "user", "assistant", "tool")
DEMO_SEED_BASE = 5_000_000  # disjoint from RAGEN's train (10000+) and validation (123+) seeds


@dataclass(frozen=True)
class Conversation:
    """One conversation's tokens, as the chat template writes them."""

    ids: tuple[int, ...]
    trained: tuple[bool, ...]  # True where the token is the assistant's: the loss is taken there only
    problem: str = ""  # the env problem it plays (`envs.split.problem_key`); "" for a data set's row

    def __len__(self) -> int:
        return len(self.ids)


def demonstrations(cfg: Config, tokenizer, seeds: list[int], noise: float, seed: int, turns: int | None = None,
                   problems: bool = True) -> list[Conversation]:
    """The env's solver playing one episode per seed (at most `turns` turns; None: `env.max_turns`), each action
    replaced by a random one with probability `noise` (stream `seed`), as conversations; `problems`: each
    conversation names the problem it plays (`envs.split.problem_key`)."""
    env = dataclasses.replace(cfg.env, max_turns=turns or cfg.env.max_turns)
    batch = rollout(None, tokenizer, seeds, 1, env, respond=solver_policy(tokenizer, env, noise, random.Random(seed)))
    first = env_first_observation(cfg.env.name, cfg.env.options()) if problems else None
    return from_rollout(batch, [problem_key(first(s)) if first else "" for s in batch.seeds])


def solver_policy(tokenizer, cfg: EnvConfig, noise: float, rng: random.Random):
    """A `respond` function for `rollout`: the env's optimal plan, each action randomised with prob `noise`.

    The reply is written as the model would continue the prompt: without the opener the prompt already ends
    with (`ChatPrompts.reply_prefix`)."""
    chat = ChatPrompts(tokenizer, enable_think=cfg.enable_think, open_answer=cfg.open_answer)
    closing = chat.closing_ids()

    def respond(trajs) -> list[list[int]]:
        out = []
        for traj in trajs:
            env = traj.env
            width = cfg.max_actions_per_turn if env.actions else 1
            try:
                plan = env.solve()[:width]
            except (ValueError, AttributeError):  # unsolvable after a noisy push, or no solver: act at random
                plan = [random_action(env, rng) for _ in range(width)]
            actions = [random_action(env, rng) if rng.random() < noise else a for a in plan]
            text = f"<answer>{' || '.join(actions)}</answer>"
            if cfg.enable_think:
                text = "<think>I work out the answer step by step.</think>" + text
            text = text.removeprefix(chat.reply_prefix)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"] + closing)
        return out

    return respond


def from_rollout(batch: RolloutBatch, problems: list[str]) -> list[Conversation]:
    """The conversations of a rollout's rows (padding dropped), trained on the tokens the policy wrote."""
    out = []
    for row in range(len(batch)):
        n = int(batch.attention_mask[row].sum())
        out.append(Conversation(tuple(batch.input_ids[row, :n].tolist()),
                                tuple(bool(m) for m in batch.response_mask[row, :n].tolist()), problems[row]))
    return out


def from_messages(tokenizer, messages: list[dict], where: str) -> Conversation:
    """A conversation in TRL's format tokenized with the tokenizer's chat template; ValueError naming `where` (the
    source and row) for a malformed one, or a template that does not write a conversation as its prefixes do."""
    _check_messages(messages, where)
    ids = _template(tokenizer, messages, generation_prompt=False)
    trained = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _template(tokenizer, messages[:i], generation_prompt=True)  # ends with the assistant's opener
        through = _template(tokenizer, messages[:i + 1], generation_prompt=False)
        if ids[:len(through)] != through or through[:len(before)] != before:
            raise ValueError(f"{where}: the chat template does not write this conversation as it writes its beginning "
                             f"(message {i + 1}), so its assistant tokens cannot be found; use model.chat_template="
                             "chatml or a template that only appends")
        trained[len(before):len(through)] = [True] * (len(through) - len(before))
    return Conversation(tuple(ids), tuple(trained))


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                        return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: `messages` must be a non-empty list of {{role, content}} (TRL's conversational "
                         f"format), got {type(messages).__name__}")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be {{role: one of {', '.join(ROLES)}, content: text}}, "
                             f"got {m!r:.80}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")


def read_conversations(source: str, tokenizer) -> list[Conversation]:
    """Every row of a data set in TRL's conversational format (`envs.data_source.read_rows`: .jsonl, .parquet, a
    `datasets` directory), tokenized."""
    rows = read_rows(source)
    if not rows:
        raise ValueError(f"sft.data={source}: no rows")
    out = []
    for location, row in rows:
        if "messages" not in row:
            raise ValueError(f"sft.data={source}, {location}: no `messages` column (TRL's conversational format: "
                             f"{{\"messages\": [{{\"role\": \"user\", \"content\": ...}}, ...]}}); it has "
                             f"{', '.join(sorted(row)) or 'none'}")
        out.append(from_messages(tokenizer, _plain_messages(row["messages"]), f"sft.data={source}, {location}"))
    return out


def _plain_messages(messages):
    """A Parquet or `datasets` row's messages as a list of dicts (they may come as arrays or tuples)."""
    try:
        return [dict(m) for m in messages]
    except (TypeError, ValueError):
        return messages


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """Indices of the sequences in each packed row: first fit, longest first (ties in index order), so rows are
    full and the result depends on the lengths only. Each row's total is at most `max_length`."""
    too_long = [n for n in lengths if n > max_length]
    if too_long:
        raise ValueError(f"{len(too_long)} conversation(s) are longer than sft.max_length={max_length} tokens "
                         f"(the longest: {max(too_long)}); raise sft.max_length")
    return pack_segments(lengths, [0] * len(lengths), max_length)


def _row(convs: list[Conversation]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ids, position ids and trained mask of `convs` one after another (one packed row, no padding). [n] each"""
    ids = [t for c in convs for t in c.ids]
    positions = [p for c in convs for p in range(len(c))]
    trained = [m for c in convs for m in c.trained]
    return torch.tensor(ids), torch.tensor(positions), torch.tensor(trained)


def packed_tensors(rows: list[list[Conversation]], pad_id: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows as tensors: input ids [R, W], position ids [R, W] (from 0 in each conversation) and the trained
    mask [R, W] (bool), W the longest row. A row's padding continues as one more sequence (positions from 0,
    never trained), so it attends only to itself."""
    parts = [_row(convs) for convs in rows]
    width = max(len(p[0]) for p in parts)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [R, W]
    positions = torch.arange(width).repeat(len(rows), 1)  # [R, W] overwritten below; padding counts from 0
    trained = torch.zeros(len(rows), width, dtype=torch.bool)  # [R, W]
    for r, (row_ids, row_positions, row_trained) in enumerate(parts):
        n = len(row_ids)
        ids[r, :n], positions[r, :n], trained[r, :n] = row_ids, row_positions, row_trained
        positions[r, n:] = torch.arange(width - n)
    return ids, positions, trained


def padded_tensors(convs: list[Conversation], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One conversation per row: input ids [N, W] (right-padded), attention mask [N, W] and trained mask [N, W]."""
    width = max(len(c) for c in convs)
    ids = torch.full((len(convs), width), pad_id, dtype=torch.long)  # [N, W]
    attention = torch.zeros(len(convs), width, dtype=torch.long)  # [N, W]
    trained = torch.zeros(len(convs), width, dtype=torch.bool)  # [N, W]
    for r, c in enumerate(convs):
        ids[r, :len(c)] = torch.tensor(c.ids)
        attention[r, :len(c)] = 1
        trained[r, :len(c)] = torch.tensor(c.trained)
    return ids, attention, trained
