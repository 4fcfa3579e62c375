"""Console output: a progress bar over training steps and a one-line summary per step.

On a terminal the bar is rich's live bar. Elsewhere (a log file, a pipe, a backgrounded run) a bar would be drawn
only once it is finished, so each step's summary line says the progress itself (`step 3/200 | ... | elapsed
0:01:10 | left 1:02:00`), and the warm start prints one line per epoch; lines are never wrapped."""

from __future__ import annotations

import time
from datetime import timedelta

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rldynamics import metric_names as names

SUMMARY_KEYS = (  # (label on the step line, metric key, what it means: printed once as the legend)
    ("reward", names.SCORE_MEAN, "mean trained reward"),
    ("success", names.env_metric("{env}", names.SUCCESS), "training success"),
    ("val", names.val_success("{env}"), "validation success"),
    ("kept", names.FILTER_KEPT_RATIO, "share of groups the filter kept"),
    ("pg", names.PG_LOSS, "policy-gradient loss"),
    ("H", names.ENTROPY, "entropy per token"),
    ("|g|", names.ACTOR_GRAD_NORM, "actor gradient norm before clipping"),
    ("s", names.STEP_TIME, "seconds for the step"),
)
LEGEND = "step lines: " + ", ".join(f"{label} = {meaning}" for label, _, meaning in SUMMARY_KEYS)


def make_console() -> Console:
    """Standard output, lines never wrapped (a log file keeps one line per step)."""
    return Console(soft_wrap=True)


def progress_bar(enabled: bool, console: Console | None = None) -> Progress:
    """A rich bar with count, elapsed and remaining time, and a free-text `info` field; inert when disabled or when
    the console is no terminal (the caller then prints plain lines, `Lines`)."""
    console = console or make_console()
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console,
        disable=not (enabled and console.is_terminal),
    )


class Lines:
    """Plain progress lines for a console that is no terminal: `label done/total | info | elapsed | left`."""

    def __init__(self, label: str, total: int, done: int = 0, enabled: bool = True, console: Console | None = None):
        self.label, self.total, self.first = label, total, done
        self.console = console or make_console()
        self.enabled = enabled and not self.console.is_terminal
        self.start = time.monotonic()

    def line(self, done: int, info: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        rate = elapsed / (done - self.first) if done > self.first else None
        left = f" | left {_clock(rate * (self.total - done))}" if rate is not None and done < self.total else ""
        self.console.print(f"{self.label} {done}/{self.total} | {info} | elapsed {_clock(elapsed)}{left}",
                           markup=False, highlight=False)
        self.console.file.flush()


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class StepConsole:
    """Progress bar plus per-step summary lines; silent when disabled.

    A probe (`probe=True`) has one step of work, the analysis of the checkpoint's step `first`: its bar and lines
    say `probe of step N`, never a training step count."""

    def __init__(self, total: int, env: str, enabled: bool = True, *, probe: bool = False, first: int = 1):
        self.env = env
        self.enabled = enabled
        self.probe = probe
        self.first = first
        self.console = make_console()
        self.progress = progress_bar(enabled, self.console)
        self.offset = first - 1 if probe else 0  # a probe counts its own work: 0/1, then 1/1
        label = f"probe of step {first}" if probe else "train"
        self.task = self.progress.add_task(label, total=total - self.offset, info="")
        self.lines = Lines("step", total, first - 1, enabled, self.console)

    def __enter__(self) -> StepConsole:
        self.progress.start()
        if not self.probe:
            self.print(f"[dim]{LEGEND}")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def phase(self, text: str) -> None:
        """Show what the current step is doing (rollout, update, validation, ...)."""
        self.progress.update(self.task, info=text)

    def advance(self, step: int, metrics: dict[str, float]) -> None:
        """Advance the bar and print the step's summary line (none for a step without metrics)."""
        self.progress.update(self.task, completed=step - self.offset, info="")
        if not (self.enabled and metrics):
            return
        if self.probe:  # its one line with metrics: the validation (--validate) of the checkpoint's step
            self.print(summary_line(self.first, metrics, self.env).replace("step", "probe of step", 1))
        elif self.lines.enabled and step > self.lines.first:
            self.lines.line(step, summary_line(step, metrics, self.env).split(" | ", 1)[-1])
        else:
            self.print(summary_line(step, metrics, self.env))

    def print(self, text: str) -> None:
        if self.enabled:
            self.progress.console.print(text)
            self.progress.console.file.flush()  # a log file shows the line now, not when a buffer fills


def summary_line(step: int, metrics: dict[str, float], env: str) -> str:
    """`step 3 | reward -0.41 | success 0.12 | ...` for the keys present in `metrics`."""
    parts = [f"step {step}"]
    for label, key, _ in SUMMARY_KEYS:
        key = key.format(env=env)
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.3g}")
    return " | ".join(parts)
