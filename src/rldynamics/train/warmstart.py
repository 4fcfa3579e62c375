"""Supervised warm start of the embedded tiny model on noisy scripted-solver demonstrations.

RL from random weights cannot discover the answer format and the grid geometry of Sokoban in a few CPU
minutes, so `model.path=tiny` first imitates an optimal solver (whose actions can be replaced by random
ones with probability `model.warm_start_noise`). The demonstrations are played through the same agent
loop as RL rollouts (`rollout(..., respond=...)`), so prompts and token layout are identical. They are
single-turn episodes by default (`model.warm_start_turns=1`): a from-scratch transformer needs many
state -> action examples before it reads the board at all, and single-state sequences give ~5x more
examples per CPU second than full episodes. The result is saved with `save_pretrained` and cached under a
key of every input that changes the demonstrated tokens (not the reward weights of one-turn
demonstrations, nor `env.max_turns`: `_env_key`), then loaded like any model.

The default's warm start ships with the package (`PACKAGED`: the weights `scripts/package_warm_start.py` computed,
about 0.6 MB), so a first `rldyn train` does not spend minutes on it, and every machine starts the default from the
same weights (a warm start computed here differs in its last bits with the CPU and the transformers version). Any
other setting of the env or of `model.warm_start_*` computes its own, once. The run's `seed` is not an input: runs
that differ only in it start from the same weights (`model.warm_start_seed` varies the warm start itself).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from rldynamics.config import Config, EnvConfig, to_dict
from rldynamics.envs import make_env
from rldynamics.envs.base import random_action
from rldynamics.models.tiny import save_tokenizer
from rldynamics.rollout.agent import state_message, system_message
from rldynamics.tracking.console import Lines, progress_bar
from rldynamics.train.batch_ops import env_seeds
from rldynamics.train.sft import supervised_step
from rldynamics.train.sft_data import DEMO_SEED_BASE, demonstrations

PACKAGED = Path(__file__).resolve().parent.parent / "models" / "warm"  # <base>-warm-<key>.safetensors


def tiny_corpus(env_cfg: EnvConfig, num_seeds: int = 200) -> list[str]:
    """Texts the tiny tokenizer is trained on: prompts and solver answers as the agent loop writes them (in
    ChatML, the tiny tokenizer's template), plus the env's own extras (Sokoban: every cell coordinate)."""
    texts = []
    for seed in range(DEMO_SEED_BASE - num_seeds, DEMO_SEED_BASE):
        env = make_env(env_cfg.name, **env_cfg.options())
        observation = env.reset(seed)
        texts.append(_chatml("system", system_message(env, env_cfg)))
        texts.append(_chatml("user", state_message(env, 1, observation, env_cfg.max_actions_per_traj)))
        for action in env.solve() if hasattr(env, "solve") else []:
            result = env.step(action)
            texts.append(f"Reward: {sum(result.reward.values()):g}\n" + result.observation)
            second = f" || {random_action(env, random.Random(seed))}" if env.actions else ""
            texts.append(f"<answer>{action}{second}</answer>")
            if result.done:
                break
    env = make_env(env_cfg.name, **env_cfg.options())
    return texts + (env.corpus_extras() if hasattr(env, "corpus_extras") else [])


def _chatml(role: str, content: str) -> str:
    """One complete ChatML message (the tiny tokenizer's chat format; its corpus is written before it exists)."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def warm_start_key(base_path: str, cfg: Config) -> str:
    """Cache key of a warm-started model: every input that changes its weights.

    The base model enters through its directory name (itself a hash of its spec), not its path, so a cache
    that is moved or shared under another `$RLDYN_CACHE` keeps its warm starts.
    """
    m = cfg.model
    inputs = [Path(base_path).name, m.warm_start_episodes, m.warm_start_turns, m.warm_start_noise,
              m.warm_start_epochs, m.warm_start_lr, m.warm_start_seed, _env_key(cfg)]
    if cfg.val.held_out > 0:  # the demonstrations avoid the held-out problems (keys from before stay valid)
        inputs.append({"held_out": cfg.val.held_out})
    blob = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _env_key(cfg: Config) -> dict:
    """The env settings in the warm-start key: those the demonstrated tokens depend on. Reward
    functions never change them; a demonstration plays `model.warm_start_turns` turns whatever
    `env.max_turns` is; the reward reaches the prompt only between turns (`Reward: x`), so the
    reward weights count only with several demonstrated turns. A setting that does not count takes
    its default, and a data set split at its default (`train`) is left out, so the keys of warm
    starts cached before stay valid. `answer_only` grades text after the answer, which a
    demonstration never has."""
    env = to_dict(cfg)["env"]
    env.pop("reward_funcs", None)
    env.pop("answer_only", None)
    env["max_turns"] = EnvConfig.max_turns
    if cfg.model.warm_start_turns == 1:
        env["reward_weights"] = {}
    if env.get("math", {}).get("split") == "train":
        env["math"].pop("split")
    return env


def ensure_warm_start(base_path: str, cfg: Config, log=print) -> str:
    """Return the directory of the warm-started tiny model: cached, else the packaged weights of the same key
    (`PACKAGED`), else trained now and cached."""
    final = Path(f"{base_path}-warm-{warm_start_key(base_path, cfg)}")
    if (final / "config.json").is_file():
        return str(final)
    from rldynamics.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(base_path)
    packaged = packaged_weights(final.name)
    if packaged.is_file():
        log(f"warm start: the packaged weights of this setting ({packaged.name}), cached in {final}")
    else:
        log(f"warm start (once, then cached in {final}): imitating {cfg.model.warm_start_episodes} solver episodes "
            f"of {cfg.model.warm_start_turns} turn(s), action noise {cfg.model.warm_start_noise}")
        supervised_warm_start(model, tokenizer, cfg, log=log)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if packaged.is_file():
        shutil.copyfile(packaged, tmp / "model.safetensors")  # saved by save_pretrained of this very model
    save_tokenizer(tokenizer, tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another process published it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def packaged_weights(name: str) -> Path:
    """Where the package keeps the weights of the warm start cached as `name` (`<base>-warm-<key>`), if it has them."""
    return PACKAGED / f"{name}.safetensors"


def demo_seeds(cfg: Config) -> list[int]:
    """The env seeds of the warm start's demonstrations: on training's side of `val.held_out`."""
    return env_seeds(cfg, [DEMO_SEED_BASE + i for i in range(cfg.model.warm_start_episodes)])


def supervised_warm_start(model, tokenizer, cfg: Config, batch_size: int = 32, log=print) -> list[float]:
    """Fit `model` to noisy solver demonstrations with `rldyn sft`'s step (token-mean NLL of the replies, one padded
    row per demonstration, `batch_size` per step); returns the steps' losses."""
    seeds = demo_seeds(cfg)
    start = time.perf_counter()
    log(f"warm start: playing {len(seeds)} solver episodes")
    demos = demonstrations(cfg, tokenizer, seeds, cfg.model.warm_start_noise, cfg.model.warm_start_seed,
                           turns=cfg.model.warm_start_turns, problems=False)
    log(f"warm start: {len(demos)} demonstrations in {time.perf_counter() - start:.0f} s; fitting them")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.model.warm_start_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.model.warm_start_seed)
    losses = []
    epochs = Lines("warm start epoch", cfg.model.warm_start_epochs, enabled=cfg.log.progress)  # no terminal: lines
    with progress_bar(cfg.log.progress) as bar:
        task = bar.add_task("warm start", total=cfg.model.warm_start_epochs * math.ceil(len(demos) / batch_size),
                            info="")
        for epoch in range(cfg.model.warm_start_epochs):
            if epoch:
                epochs.line(epoch, f"NLL {losses[-1]:.3f} nats/token")
            for rows in torch.split(torch.randperm(len(demos), generator=generator), batch_size):
                step = supervised_step(model, optimizer, [[demos[i]] for i in rows.tolist()],
                                       tokenizer.pad_token_id, packed=False, micro_batch_size=batch_size)
                losses.append(step.loss)
                bar.update(task, advance=1, info=f"NLL {losses[-1]:.3f} nats/token")
        epochs.line(cfg.model.warm_start_epochs, f"NLL {losses[-1]:.3f} nats/token")
    model.eval()
    return losses
