"""Early stopping rules (RAGEN's three, thresholds in `EarlyStopConfig`), with state for checkpoints.

1. Reward-variance collapse: the first `rv_baseline_steps` non-empty steps give a baseline mean of
   `rollout/in_group_reward_std`; afterwards, if the last `rv_window` values are all below
   `rv_ratio * baseline`, stop. Checked before the step's update.
2. Low validation success: each in-loop validation with success < threshold increments a counter,
   any other resets it; `val_patience` in a row stops the run.
3. Empty filtered batches: `filter.empty_stop_steps` consecutive empty steps stop the run.

A probe (`train/probe.py`) keeps the counts of its checkpoint and never stops: the policy never changes there,
and a probe of the last checkpoint of a run that stopped early must still reach its analysis.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rldynamics.config import Config, EarlyStopConfig


@dataclass
class EarlyStopper:
    cfg: EarlyStopConfig
    empty_stop_steps: int
    baseline: list[float] = field(default_factory=list)
    window: list[float] = field(default_factory=list)
    low_val: int = 0
    empty: int = 0

    @classmethod
    def for_run(cls, cfg: Config) -> EarlyStopper:
        """The stopper of a run: `cfg.early_stop`."""
        return cls(cfg.early_stop, cfg.filter.empty_stop_steps)

    def after_rollout(self, reward_std: float, empty: bool) -> str | None:
        """Record a step's pre-filter mean group reward std; returns a stop reason or None."""
        if empty:
            self.empty += 1
            if self.cfg.enabled and 0 < self.empty_stop_steps <= self.empty:
                return "empty_filtered_steps"
            return None
        self.empty = 0
        if len(self.baseline) < self.cfg.rv_baseline_steps:
            self.baseline.append(reward_std)
            return None
        self.window = (self.window + [reward_std])[-self.cfg.rv_window:]
        base = sum(self.baseline) / len(self.baseline)
        if self.cfg.enabled and len(self.window) == self.cfg.rv_window and all(
                v < self.cfg.rv_ratio * base for v in self.window):
            return "reward_variance_collapse"
        return None

    def after_validation(self, success: float) -> str | None:
        """Record an in-loop validation success rate; returns a stop reason or None."""
        self.low_val = self.low_val + 1 if success < self.cfg.val_success_threshold else 0
        if self.cfg.enabled and self.low_val >= self.cfg.val_patience:
            return "low_validation_success"
        return None

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("cfg", "empty_stop_steps")}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; ValueError when it is not one (other keys or value types)."""
        expected = self.state_dict()
        if not isinstance(state, dict) or set(state) != set(expected):
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"early-stop state has keys {keys}, expected {sorted(expected)}")
        for k, v in state.items():
            number = (int, float) if isinstance(expected[k], list) else int
            items = v if isinstance(v, list) else [v]
            if type(v) is not type(expected[k]) or any(isinstance(x, bool) or not isinstance(x, number) for x in items):
                raise ValueError(f"early-stop state {k!r} is {v!r}, expected {type(expected[k]).__name__}")
        for k, v in state.items():
            setattr(self, k, v)
