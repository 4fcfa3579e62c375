"""Reading a run directory for plots: metrics rows, analysis steps, per-bucket tables, groups and sketches.

Design choices:
- Only the run directory is read (``tracking.run_dir`` + ``analysis/step_<N>/``), never torch or training code,
  so figures can be rebuilt on any machine the directory is copied to.
- A missing metric is ``nan`` ("not logged"), never 0: plots show it as missing instead of as a zero bar.
- An analysis step is a metrics row with at least one non-zero ``grad_norm/bucket_*`` value (RAGEN's rule;
  ``nan`` counts as non-zero so a run whose analysis produced non-finite norms still gets its figures).
- ``analysis/step_<N>/metrics.json`` fills keys missing from the row of step N (the row wins on conflicts).
- Odd data never stops a figure: rows without a whole, finite ``step``, undecodable lines (bad bytes, a row cut
  by a kill), unreadable ``metrics.json`` / ``config.yaml`` / sketch files are skipped (with a warning where the
  run has one), and values beyond ±1e300 count as overflowed (drawn like inf: matplotlib cannot place ticks on
  an axis that wide).
- Buckets are labelled by the run's ``analysis.bucket_mode`` (``Q3`` for quantile buckets, ``[2, 3)`` for
  fixed_rv buckets, whose names always denote the same interval; ``rldynamics.metric_names``).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rldynamics import metric_names as naming
from rldynamics.tracking.run_dir import EVENTS_FILE, ROLLED_BACK, read_config, read_events, read_metrics

PREFIX = naming.GRAD_NORM
COMPONENTS = ("task", "entropy", "kl")
PLOT_LIMIT = 1e300  # larger magnitudes are treated as overflowed (inf)
MAX_STEP = 2**63 - 1


@dataclass
class RunData:
    """One run directory, loaded: merged metrics rows (one per step, sorted) and the resolved config."""

    path: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    events: list[HealthEvent] = field(default_factory=list)  # events.jsonl, then the rolled-back attempts' alarms

    @property
    def name(self) -> str:
        """`log.name` from the config, else the directory name."""
        log = self.config.get("log") if isinstance(self.config.get("log"), dict) else {}
        return str(log.get("name") or self.path.name)

    @property
    def bucket_mode(self) -> str:
        """`analysis.bucket_mode` from the config (quantile when not recorded)."""
        analysis = self.config.get("analysis") if isinstance(self.config.get("analysis"), dict) else {}
        return str(analysis.get("bucket_mode") or "quantile")

    @property
    def zero_bucket(self) -> bool:
        """`analysis.zero_bucket` from the config (False when not recorded: runs from before the option)."""
        analysis = self.config.get("analysis") if isinstance(self.config.get("analysis"), dict) else {}
        return bool(analysis.get("zero_bucket", False))

    def row(self, step: int) -> dict[str, Any]:
        """The merged metrics row of `step` (KeyError if the step was never logged)."""
        for r in self.rows:
            if r["step"] == step:
                return r
        raise KeyError(step)


def load_run(run_dir: str | Path) -> RunData:
    """Read `metrics.jsonl` (required), `config.yaml` (optional) and the analysis `metrics.json` files."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    warnings: list[str] = []
    by_step: dict[int, dict[str, Any]] = {}
    for r in _read_rows(path, warnings):
        step = _step_of(r)
        if step is None:
            warnings.append(f"metrics.jsonl: a row without a whole, finite step ({str(r)[:60]}); skipped")
            continue
        by_step.setdefault(step, {}).update(r, step=step)  # a step logged twice: later values win
    for step, extra in _analysis_metrics(path).items():
        row = by_step.setdefault(step, {"step": step})
        for k, v in extra.items():
            row.setdefault(k, v)
    config: dict[str, Any] = {}
    if (path / "config.yaml").exists():
        try:
            loaded = read_config(path)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            loaded = None
            warnings.append(f"config.yaml could not be parsed ({e.__class__.__name__}); config ignored")
        config = loaded if isinstance(loaded, dict) else {}
    return RunData(path=path, rows=[by_step[s] for s in sorted(by_step)], config=config, warnings=warnings,
                   events=load_events(path, warnings))


def _step_of(row: Any) -> int | None:
    """The step of a metrics row: a whole, finite number (bools and `Infinity` are not steps)."""
    step = row.get("step") if isinstance(row, dict) else None
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return int(step) if step == int(step) and abs(step) <= MAX_STEP else None


def _read_rows(path: Path, warnings: list[str]) -> list[Any]:
    """`read_metrics`, falling back to skipping undecodable lines (bad bytes, a half-written last line)."""
    try:
        return read_metrics(path)
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        rows = []
        for i, line in enumerate((path / "metrics.jsonl").read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line.decode("utf-8")))
            except (ValueError, UnicodeDecodeError):
                warnings.append(f"metrics.jsonl line {i} is not valid UTF-8 JSON; skipped")
        return rows


@dataclass(frozen=True)
class HealthEvent:
    """One row of `events.jsonl` (`tracking.run_dir.read_events`): an alarm, or a rollback (`rule` "rollback",
    `from_step` and `archive` set). `undone`: the `rolled_back/` attempt it was read from (an alarm of a step that a
    rollback undid, the one that asked for it among them), None for a row of the run's own events.jsonl."""

    step: int
    rule: str
    action: str
    message: str = ""
    value: float | None = None
    threshold: float | None = None
    since: int | None = None
    from_step: int | None = None
    archive: str | None = None
    undone: str | None = None
    ends_with: int | None = None  # a stop that leaves the state of this earlier step as the last checkpoint

    @property
    def is_rollback(self) -> bool:
        return self.action == "rollback" and self.from_step is not None


def load_events(path: Path, warnings: list[str]) -> list[HealthEvent]:
    """The health events of a run: its `events.jsonl`, then those of every `rolled_back/attempt_<k>/events.jsonl`
    (with `undone` set). Rows without a whole step, or with a rule or action that is not text, are skipped with a
    warning; none when the run wrote no events."""
    sources = [(path, None)] + [(d, d.name) for d in sorted((path / ROLLED_BACK).glob("attempt_*"),
                                                             key=lambda d: (len(d.name), d.name)) if d.is_dir()]
    events = []
    for directory, undone in sources:
        where = f"{ROLLED_BACK}/{undone}/{EVENTS_FILE}" if undone else EVENTS_FILE
        for number, row in enumerate(_event_rows(directory, where, warnings), start=1):
            event = _event(row, undone)
            if event is None:
                warnings.append(f"{where}: row {number} is not a health event ({str(row)[:60]}); skipped")
            else:
                events.append(event)
    return events


def _event_rows(directory: Path, where: str, warnings: list[str]) -> list[Any]:
    """`read_events`, falling back to skipping undecodable lines (bad bytes, a damaged line before the last)."""
    try:
        return read_events(directory)
    except (ValueError, UnicodeDecodeError, OSError):
        rows = []
        try:
            lines = (directory / EVENTS_FILE).read_bytes().splitlines()
        except OSError as e:
            warnings.append(f"{where} could not be read ({e.__class__.__name__}); its events are left out")
            return []
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line.decode("utf-8")))
            except (ValueError, UnicodeDecodeError):
                if i < len(lines):
                    warnings.append(f"{where} line {i} is not valid UTF-8 JSON; skipped")
        return rows


def _event(row: Any, undone: str | None) -> HealthEvent | None:
    """A `HealthEvent` of an events.jsonl row, or None when it has no whole step or its rule or action is not text."""
    step = _step_of(row)
    if step is None or not isinstance(row.get("rule"), str) or not isinstance(row.get("action"), str):
        return None
    value, threshold = as_float(row.get("value")), as_float(row.get("threshold"))
    since, from_step = _step_of({"step": row.get("since")}), _step_of({"step": row.get("from_step")})
    ends_with = _step_of({"step": row.get("ends_with")})
    return HealthEvent(step=step, rule=row["rule"], action=row["action"], message=str(row.get("message", "")),
                       value=None if math.isnan(value) else value,
                       threshold=None if math.isnan(threshold) else threshold, since=since, from_step=from_step,
                       archive=row["archive"] if isinstance(row.get("archive"), str) else None, undone=undone,
                       ends_with=ends_with)


def _analysis_metrics(path: Path) -> dict[int, dict[str, Any]]:
    """step -> the `metrics.json` of `analysis/step_<step>/` (unreadable files are skipped)."""
    out = {}
    for step, d in analysis_dirs(path).items():
        file = d / "metrics.json"
        if file.exists():
            try:
                data = json.loads(file.read_bytes())
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(data, dict):
                out[step] = data
    return out


def analysis_dirs(run_dir: str | Path) -> dict[int, Path]:
    """step -> `analysis/step_<step>/` for every such directory."""
    root = Path(run_dir) / "analysis"
    out = {}
    if root.is_dir():
        for d in root.iterdir():
            m = re.fullmatch(r"step_(\d+)", d.name)
            if m and d.is_dir():
                out[int(m.group(1))] = d
    return dict(sorted(out.items()))


def as_float(value: Any) -> float:
    """A metric value as a float; `nan` when missing or not a number, ±inf beyond ±`PLOT_LIMIT`."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value) if not abs(value) > PLOT_LIMIT else math.copysign(math.inf, value)  # nan stays nan
    return math.nan


def is_analysis_row(row: dict[str, Any], prefix: str = PREFIX) -> bool:
    """True if the row has at least one non-zero numeric `<prefix>/bucket_*` value."""
    head = f"{prefix}/bucket_"
    return any(k.startswith(head) and isinstance(v, (int, float)) and v != 0 for k, v in row.items())


def analysis_steps(run: RunData, prefix: str = PREFIX) -> list[int]:
    """Sorted steps whose metrics row is an analysis row."""
    return [r["step"] for r in run.rows if is_analysis_row(r, prefix)]


def bucket_names(row: dict[str, Any], prefix: str = PREFIX) -> list[str]:
    """`bucket_k` names present in the row, sorted numerically."""
    found = {parsed[0] for k in row if (parsed := naming.parse_bucket_metric(k, prefix)) and parsed[0] != naming.ALL}
    return sorted(found, key=naming.bucket_number)


def bucket_label(bucket: str, mode: str = "quantile", zero_bucket: bool = False) -> str:
    """`bucket_0` -> `RV=0`, `bucket_3` -> `Q3` (quantile) or `[2, 3)` (fixed_rv; `(0, 1)` for the first interval
    when `zero_bucket` held RV = 0 apart); `all` -> `all`."""
    return naming.bucket_label(bucket, mode, zero_bucket=zero_bucket)


def bucket_values(row: dict[str, Any], buckets: list[str], metric: str, prefix: str = PREFIX) -> np.ndarray:
    """`[len(buckets)]` float array of `<prefix>/<bucket>/<metric>`, nan where not logged."""
    return np.array([as_float(row.get(naming.bucket_metric(prefix, b, metric))) for b in buckets], dtype=float)


def bucket_metric_names(row: dict[str, Any], prefix: str = PREFIX) -> list[str]:
    """Every metric name logged for some bucket (e.g. `task`, `raw/kl`, `loss/policy`), in a stable order."""
    names = {parsed[1] for k in row if (parsed := naming.parse_bucket_metric(k, prefix))}
    return sorted(names, key=_metric_order)


_ORDER = ["sample_count", "sample_pct", "group_rv_count", "reward_std_mean", "reward_std_min", "reward_std_max",
          "task", "entropy", "kl", "raw/entropy", "raw/kl", "regularizer", "reg_share", "zero_grad/task",
          "zero_grad/entropy", "zero_grad/kl"]


def _metric_order(name: str) -> tuple[int, str]:
    return (_ORDER.index(name), name) if name in _ORDER else (len(_ORDER), name)


def norm_is_zero(row: dict[str, Any], bucket: str, comp: str, prefix: str = PREFIX) -> bool:
    """True when the gradient of `comp` in `bucket` is exactly the zero vector, so its cosines are undefined.

    Read from the probe's `zero_grad/<comp>` flag (its cosines are then NaN); runs written before the flag existed
    logged those cosines as 0, and a (raw) norm of exactly 0 tells the same.
    """
    flag = row.get(naming.bucket_metric(prefix, bucket, f"zero_grad/{comp}"))
    if isinstance(flag, (int, float)):
        return flag == 1
    for key in (naming.bucket_metric(prefix, bucket, f"raw/{comp}"), naming.bucket_metric(prefix, bucket, comp)):
        if isinstance(row.get(key), (int, float)):
            return row[key] == 0
    return False


def bucket_intervals(row: dict[str, Any], buckets: list[str], metric: str,
                     prefix: str = PREFIX) -> tuple[np.ndarray, np.ndarray] | None:
    """(`ci_low`, `ci_high`) arrays of `<prefix>/<bucket>/<metric>` (nan where not logged); None if none logged."""
    low = bucket_values(row, buckets, f"{metric}/ci_low", prefix)
    high = bucket_values(row, buckets, f"{metric}/ci_high", prefix)
    return (low, high) if np.isfinite(low).any() else None


def is_zero_rv(row: dict[str, Any], buckets: list[str], prefix: str = PREFIX) -> np.ndarray:
    """`[B]` bool: buckets whose groups all have reward std 0 (`bucket_0`, or RAGEN quantiles of zero-RV groups)."""
    top = bucket_values(row, buckets, "reward_std_max", prefix)
    return np.array([b == naming.ZERO_BUCKET for b in buckets], dtype=bool) | (top == 0)


def read_group_norms(run_dir: str | Path, step: int, prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """Per-group columns of `groups.csv` (`reward_std`, `task`, `regularizer`, ... with `analysis.per_group`):
    column -> `[groups]` float array (nan where blank); empty when the file has no per-group norms."""
    file = Path(run_dir) / "analysis" / f"step_{step}" / "groups.csv"
    if not file.exists():
        return {}
    rows = [r for r in _csv_rows(file) if r.get("prefix", PREFIX) == prefix]
    if not rows or not any(r.get("task") for r in rows):
        return {}
    keys = [k for k in rows[0] if k not in ("prefix", "bucket", "seed")]
    out = {k: np.array([as_float(_parse_float(r.get(k))) for r in rows], dtype=float) for k in keys}
    out["bucket"] = np.array([r["bucket"] for r in rows])
    return out


def regularizer_values(row: dict[str, Any], buckets: list[str], prefix: str = PREFIX) -> np.ndarray:
    """Per-bucket regulariser (entropy + KL) gradient norm: the logged `regularizer` (norm of the summed
    weighted vector) where present, else the sum of the logged `entropy` and `kl` norms (nan if neither)."""
    reg = bucket_values(row, buckets, "regularizer", prefix)
    ent = bucket_values(row, buckets, "entropy", prefix)
    kl = bucket_values(row, buckets, "kl", prefix)
    with np.errstate(over="ignore", invalid="ignore"):  # inf stays inf (nan_to_num would make it 1.8e308)
        summed = np.where(np.isnan(ent) & np.isnan(kl), np.nan, np.where(np.isnan(ent), 0.0, ent) +
                          np.where(np.isnan(kl), 0.0, kl))
    return np.where(np.isnan(reg), summed, reg)


def read_groups(run_dir: str | Path, step: int, prefix: str = PREFIX) -> dict[str, list[float]]:
    """bucket -> per-group reward stds from `analysis/step_<step>/groups.csv` (only rows of `prefix`).

    Empty when the file is missing. Files without a `prefix` column (older layout) are taken as `grad_norm`.
    """
    file = Path(run_dir) / "analysis" / f"step_{step}" / "groups.csv"
    out: dict[str, list[float]] = {}
    if not file.exists():
        return out
    for r in _csv_rows(file):
        if r.get("prefix", PREFIX) != prefix or not r.get("bucket"):
            continue
        out.setdefault(r["bucket"], []).append(as_float(_parse_float(r.get("reward_std"))))
    return dict(sorted(out.items(), key=lambda kv: bucket_sort_key(kv[0])))


def _csv_rows(file: Path) -> list[dict[str, str]]:
    """The rows of a CSV file as dicts; bad bytes become U+FFFD, and a malformed line ends the rows read."""
    rows = []
    with open(file, newline="", encoding="utf-8", errors="replace") as f:
        try:
            rows.extend(csv.DictReader(f))
        except csv.Error:
            pass  # the rows read so far are kept
    return rows


def _parse_float(text: str | None) -> float:
    try:
        return float(text) if text is not None else math.nan
    except (ValueError, TypeError):
        return math.nan


def bucket_sort_key(bucket: str) -> tuple[int, int | str]:
    """Sort key: `bucket_1`, `bucket_2`, ... by number, then other names (`all`)."""
    k = naming.bucket_number(bucket)
    return (0, k) if k is not None else (1, bucket)


def read_sketches(run_dir: str | Path, step: int) -> dict[str, np.ndarray]:
    """`<prefix>/<bucket>/<component>` -> `[dim]` count-sketch from `sketches.safetensors` (empty if missing)."""
    file = Path(run_dir) / "analysis" / f"step_{step}" / "sketches.safetensors"
    if not file.exists():
        return {}
    from safetensors.numpy import load_file

    try:
        return {k: np.asarray(v, dtype=np.float64) for k, v in load_file(str(file)).items()}
    except Exception:  # a corrupted or foreign file (safetensors raises its own error types): no sketches
        return {}


def env_names(run: RunData) -> list[str]:
    """Environment names: `env.name` from the config, plus any found in `train/<env>/...` or `val-env/<env>/...`."""
    names = []
    env = run.config.get("env")
    if isinstance(env, dict) and env.get("name"):
        names.append(str(env["name"]))
    for r in run.rows:
        for k in r:
            parsed = naming.parse_env_metric(k)
            if parsed and parsed[2] == naming.SUCCESS and parsed[1] not in names:
                names.append(parsed[1])
    return names


def series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the metrics rows (`RunData.rows`) that have `key` and a step; values may contain nan/inf
    (as logged)."""
    pairs = [(r["step"], as_float(r[key])) for r in rows if key in r and "step" in r]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pairs, strict=True)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


TERM_COEFS = {"kl": "kl_coef", "entropy": "entropy_coef"}


def off_terms(config: dict[str, Any]) -> dict[str, str]:
    """The loss terms a run's config switched off, each with the setting that did (`{"kl": "algo.kl_coef=0"}`):
    their weighted gradient, loss and curve are 0 by construction, so figures say "off" instead of drawing zeros."""
    algo = config.get("algo") if isinstance(config.get("algo"), dict) else {}
    return {term: f"algo.{key}=0" for term, key in TERM_COEFS.items() if key in algo and as_float(algo[key]) == 0}


@dataclass
class Headline:
    """The numbers a report starts with. `val`: ((first step, value), (last step, value), (best step, value)) of the
    validation success, None when not validated; `wall_s`: the logged step and validation times summed."""

    val: tuple[tuple[int, float], tuple[int, float], tuple[int, float]] | None
    last_step: int | None
    steps: int | None
    stopped: str
    wall_s: float | None
    left: int | None = None  # the step whose state a health stop left as the last checkpoint, when not its own


def headline(run: RunData) -> Headline:
    """The run's headline numbers from its metrics rows and config."""
    envs = env_names(run)
    x, y = series(run.rows, naming.val_success(envs[0])) if envs else (np.zeros(0), np.zeros(0))
    ok = np.isfinite(y)
    x, y = x[ok].astype(int), y[ok]
    val = None
    if y.size:
        best = int(np.argmax(y))
        val = ((int(x[0]), float(y[0])), (int(x[-1]), float(y[-1])), (int(x[best]), float(y[best])))
    train = run.config.get("train") if isinstance(run.config.get("train"), dict) else {}
    steps = train.get("steps") if isinstance(train.get("steps"), int) else None
    stops = early_stops(run)
    times = [as_float(r.get(naming.STEP_TIME)) for r in run.rows] + [as_float(run.rows[0].get(naming.VAL_TIME))
                                                                     if run.rows and run.rows[0]["step"] == 0 else 0.0]
    times = [t for t in times if math.isfinite(t)]
    return Headline(val=val, last_step=run.rows[-1]["step"] if run.rows else None, steps=steps,
                    stopped=f"early stop at step {stops[0][0]}: {stops[0][1]}" if stops else "",
                    wall_s=float(sum(times)) if times else None, left=left_state(run))


def left_state(run: RunData) -> int | None:
    """The step whose state a health stop left as the run's last checkpoint (the earliest its stop events name),
    or None when the run left its own last state."""
    kept = [e.ends_with for e in run.events if e.undone is None and e.ends_with is not None]
    return min(kept) if kept else None


def early_stops(run: RunData) -> list[tuple[int, str]]:
    """(step, reason) of every `early_stopped/<reason>` flag the run logged."""
    return [(r["step"], reason) for r in run.rows for k, v in r.items()
            if (reason := naming.early_stop_reason(k)) is not None and v]


def has_key(run: RunData, key: str) -> bool:
    """True if any row logged `key`."""
    return any(key in r for r in run.rows)
