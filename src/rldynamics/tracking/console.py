"""Console output: a rich progress bar over training steps and a one-line summary per step."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rldynamics import metric_names as names

SUMMARY_KEYS = (
    ("reward", names.SCORE_MEAN),
    ("success", names.env_prefix("{env}") + "/success"),
    ("val", names.val_success("{env}")),
    ("kept", names.FILTER_KEPT_RATIO),
    ("pg", names.actor("pg_loss")),
    ("H", names.ENTROPY),
    ("|g|", names.actor("grad_norm")),
    ("s", names.STEP_TIME),
)


def progress_bar(enabled: bool, console: Console | None = None) -> Progress:
    """A rich bar with count, elapsed and remaining time, and a free-text `info` field; inert when disabled."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console, disable=not enabled,
    )


class StepConsole:
    """Progress bar plus per-step summary lines; silent when disabled."""

    def __init__(self, total: int, env: str, enabled: bool = True):
        self.env = env
        self.enabled = enabled
        self.console = Console()
        self.progress = progress_bar(enabled, self.console)
        self.task = self.progress.add_task("train", total=total, info="")

    def __enter__(self) -> StepConsole:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def phase(self, text: str) -> None:
        """Show what the current step is doing (rollout, update, validation, ...)."""
        self.progress.update(self.task, info=text)

    def advance(self, step: int, metrics: dict[str, float]) -> None:
        """Advance the bar and print the step's summary line."""
        self.progress.update(self.task, completed=step, info="")
        if self.enabled:
            self.progress.console.print(summary_line(step, metrics, self.env))

    def print(self, text: str) -> None:
        if self.enabled:
            self.progress.console.print(text)


def summary_line(step: int, metrics: dict[str, float], env: str) -> str:
    """`step 3 | reward -0.41 | success 0.12 | ...` for the keys present in `metrics`."""
    parts = [f"step {step}"]
    for label, key in SUMMARY_KEYS:
        key = key.format(env=env)
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.3g}")
    return " | ".join(parts)
