"""A two-armed text bandit (RAGEN's Bandit): one turn, pull one of two named arms, receive its payoff.

Design choices:
- Behaviour follows RAGEN's `BanditEnv`: each episode shows one pair of arm names (a "safe" profession
  and a "risky" one, e.g. Teacher / Trader), in random order; the safe arm pays a fixed `safe_payoff`
  (RAGEN: 0.1), the risky arm pays `risky_payoff` with probability `risky_hit_prob` and
  `risky_miss_payoff` otherwise (RAGEN: 1.0 with probability 0.25, else 0), so the risky arm is the better
  one on average (0.25 > 0.1) and the names hint at it. The episode ends after one pull. The reward
  component is `payoff`; `success` means the arm with the higher expected payoff was pulled (RAGEN's
  success at its defaults: the risky arm). The arm names are RAGEN's 12 training pairs (`split=train`) or
  its 8 held-out pairs (`split=test`), or the user's own (`arm_pairs`).
- Determinism: the pair, its order and the risky arm's hit are drawn from `random.Random(f"bandit/{seed}/...")`
  through `Random.random()` only, so a seed gives the same episode everywhere. RAGEN offsets each env's
  seed by a process-wide counter so that the members of a group draw their payoffs independently; here the
  members of a group share the draw (their seed), so members that pull the same arm get the same payoff
  and a group's reward spread comes from its choices alone. A consequence worth knowing: per seed the
  risky arm either beats the safe one for everybody (25 %) or loses for everybody (75 %), so an estimator
  that standardises rewards within a group (GRPO with `algo.norm_adv_by_std=true`) gives both cases
  advantages of equal size and pushes toward the safe arm, while RLOO weights them by the payoff gap and
  follows the expected payoff (docs/environments.md: measured with the tiny model).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from rldynamics.envs.base import StepResult, int_at_least, probability, randbelow

# RAGEN's arm names, [safe arm, risky arm].
RAGEN_PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (
        ("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
        ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
        ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"), ("Postman", "Pilot"),
        ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer"),
    ),
    "test": (
        ("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
        ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
        ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator"),
    ),
}  # fmt: skip


def _arm_pairs(split: str, arm_pairs: Sequence[Sequence[str]]) -> tuple[tuple[str, str], ...]:
    """The [safe, risky] name pairs in use: `arm_pairs` when given, else RAGEN's `split`; checked."""
    if not arm_pairs:
        if split not in RAGEN_PAIRS:
            raise ValueError(f"unknown split {split!r}; allowed: {', '.join(RAGEN_PAIRS)} (or set arm_pairs)")
        return RAGEN_PAIRS[split]
    pairs = []
    for pair in arm_pairs:
        if isinstance(pair, str) or len(pair) != 2:
            raise ValueError(f"arm_pairs must be [safe arm, risky arm] name pairs, got {pair!r}")
        for name in pair:
            if not isinstance(name, str) or not name.strip() or name != name.strip() or "||" in name:
                raise ValueError(f"arm names must be non-empty words without outer spaces or '||', got {name!r}")
        if pair[0].casefold() == pair[1].casefold():
            raise ValueError(f"the two arms of a pair need different names, got {list(pair)}")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


@dataclass
class BanditConfig:
    """Bandit's keys (`env.bandit.<key>`); defaults are RAGEN's Bandit tag."""

    split: str = "train"
    """RAGEN's arm names: train (12 pairs) | test (8 held-out pairs); ignored when arm_pairs is set."""
    arm_pairs: list[list[str]] = field(default_factory=list)
    """Own [safe arm, risky arm] name pairs, e.g. [[Teacher,Trader],[Nurse,Pilot]] (empty: RAGEN's split)."""
    safe_payoff: float = 0.1
    """Payoff of the safe arm (fixed)."""
    risky_payoff: float = 1.0
    """Payoff of the risky arm on a hit."""
    risky_miss_payoff: float = 0.0
    """Payoff of the risky arm on a miss."""
    risky_hit_prob: float = 0.25
    """Probability that the risky arm hits."""


class BanditEnv:
    """Two named arms, one pull; see the module docstring.

    Args: the fields of `BanditConfig`.

    `actions` are the two arm names of the current episode (before the first reset: every arm name).
    """

    Config = BanditConfig
    reward_names: tuple[str, ...] = ("payoff",)
    reward_weights: dict[str, float] = {}

    def __init__(self, split: str = "train", arm_pairs: Sequence[Sequence[str]] = (), safe_payoff: float = 0.1,
                 risky_payoff: float = 1.0, risky_miss_payoff: float = 0.0, risky_hit_prob: float = 0.25) -> None:
        self.pairs = _arm_pairs(split, arm_pairs)
        self.safe_payoff, self.risky_payoff = float(safe_payoff), float(risky_payoff)
        self.risky_miss_payoff = float(risky_miss_payoff)
        self.risky_hit_prob = probability("risky_hit_prob", risky_hit_prob)
        risky_mean = self.risky_hit_prob * self.risky_payoff + (1 - self.risky_hit_prob) * self.risky_miss_payoff
        if math.isclose(risky_mean, self.safe_payoff):
            raise ValueError(f"both arms have expected payoff {risky_mean:g}; success (pulling the better arm) "
                             "needs them to differ")
        self.risky_is_better = risky_mean > self.safe_payoff
        self.actions: tuple[str, ...] = tuple(dict.fromkeys(name for pair in self.pairs for name in pair))
        self.safe = self.risky = ""
        self.pulled: str | None = None
        self.hit = False

    def instructions(self) -> str:
        """The game and the two arms of this episode, for the system prompt."""
        return ("You are playing a bandit game: pull one of two arms to get the highest reward. Each arm pays from "
                "its own distribution, related to its name; pull the arm you expect to pay more on average.\n"
                f"Actions: {', '.join(self.actions)}.")

    def reset(self, seed: int) -> str:
        """Draw the arm pair, its order and the risky arm's hit for `seed` (an integer >= 0)."""
        seed = int_at_least("seed", seed, 0)
        rng = random.Random(f"bandit/{seed}/arms")
        self.safe, self.risky = self.pairs[randbelow(rng, len(self.pairs))]
        self.actions = (self.safe, self.risky) if rng.random() < 0.5 else (self.risky, self.safe)
        self.hit = random.Random(f"bandit/{seed}/payoff").random() < self.risky_hit_prob
        self.pulled = None
        return f"Arms: {self.actions[0]} and {self.actions[1]}. Which arm do you pull?"

    def step(self, action: str) -> StepResult:
        """Pull arm `action` (one of this episode's two names); the episode ends."""
        if not self.safe:
            raise RuntimeError("no episode yet; call reset(seed) first")
        if self.pulled is not None:
            raise RuntimeError("the arm was already pulled; call reset() first")
        if action not in (self.safe, self.risky):
            raise ValueError(f"unknown arm {action!r}; allowed: {', '.join(self.actions)}")
        self.pulled = action
        payoff = self.safe_payoff if action == self.safe else self.risky_payoff if self.hit else self.risky_miss_payoff
        info = {"action_is_effective": 1.0, "action_is_valid": 1.0, "success": float(self.success())}
        return StepResult(f"{action}: {payoff:g} points", {"payoff": payoff}, True, info)

    def success(self) -> bool:
        """True when the arm with the higher expected payoff was pulled."""
        return self.pulled is not None and self.pulled == self.solve()[0]

    def solve(self) -> list[str]:
        """The arm with the higher expected payoff (for the tiny model's warm start)."""
        if not self.safe:
            raise RuntimeError("no episode yet; call reset(seed) first")
        return [self.risky if self.risky_is_better else self.safe]

    def corpus_extras(self) -> list[str]:
        """Extra tokenizer-corpus texts: every arm name (RAGEN's held-out names too)."""
        names = {name for pairs in (self.pairs, *RAGEN_PAIRS.values()) for pair in pairs for name in pair}
        return [" ".join(sorted(names))] * 20
