"""Behaviour unchanged: seeded jobs run by one checkout, compared file by file with the same jobs run by another.

    python scripts/behaviour_check.py run OUT          # the jobs below into OUT/ (one thread, minutes on a CPU)
    python scripts/behaviour_check.py compare A B      # every file of A against B; exit 1 on a difference

The jobs cover the step's paths: the default with the gradient analysis every step and records, PPO with a critic,
math with reward gradients, collapse diagnostics and TIS, a probe of a checkpoint, a replay with `--attribute`, a
health rollback and a LoRA run. `compare` reads metrics.jsonl, rewards.jsonl, events.jsonl and the other JSON
files row by row without their wall times (`timing_s/*`, step and validation times), the step records and
checkpoints tensor by tensor (safetensors; torch files by their tensors) with the record's run identity left out,
and every other file by its text with the output directory's path replaced. A refactor of the step that leaves
behaviour as it was shows no difference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

ONE = ["model.threads=1", "log.progress=false", "val.env_groups=8"]
JOBS = {  # name -> rldyn arguments ({out} is the output directory)
    "default": ["train", "train.steps=4", "analysis.every=1", "val.every=2", "checkpoint.every=2", "record.every=2",
                "log.report=false", *ONE],
    "ppo": ["train", "--preset", "sokoban-tiny-ppo", "train.steps=3", "critic.warmup_steps=1", "checkpoint.every=3",
            "record.every=1", "val.every=3", "log.report=false", *ONE],
    "math": ["train", "--preset", "math-tiny", "train.steps=3", "analysis.every=1", "collapse.enabled=true",
             "algo.tis_cap=2.0", "val.every=3", "checkpoint.every=3", "record.every=1", "log.report=false", *ONE],
    "probe": ["probe", "{out}/default/checkpoints/step_2", "log.name=probe", *ONE],
    "replay": ["replay", "{out}/default", "--step", "2", "--attribute"],
    "rollback": ["train", "--preset", "math-tiny", "train.group_size=3", "env.max_new_tokens=40", "env.max_turns=1",
                 "env.math.length_target=20", "train.mini_batch_size=64", "train.ppo_epochs=1", "train.steps=6",
                 "checkpoint.every=1", "val.every=0", "health.baseline_steps=1", "health.entropy_collapse_ratio=1.0",
                 "health.entropy_collapse=rollback", "health.max_rollbacks=1", "analysis.enabled=false",
                 "log.report=false", *ONE],
    "lora": ["train", "--preset", "math-tiny", "model.lora.rank=4", "train.steps=3", "analysis.every=2",
             "val.every=3", "checkpoint.every=3", "log.report=false", *ONE],
}
SKIP_FILES = {"environment.jsonl", "run_id", ".lock", "report.html"}
SKIP_SUFFIXES = (".log", ".png", ".svg", ".pdf")


def run(out: Path) -> None:
    """Run every job into `out/<job>` (a job whose directory exists is skipped)."""
    out = out.resolve()
    for name, args in JOBS.items():
        if (out / name).exists() and name not in ("replay",):
            continue
        args = [a.replace("{out}", str(out)) for a in args]
        if args[0] in ("train", "probe"):
            args += [f"log.run_dir={out}", f"log.name={name}"]
        print(f"== {name}: rldyn {' '.join(args)}", flush=True)
        subprocess.run([sys.executable, "-m", "rldynamics.cli", *args], check=True)


def timeless(row):
    """A JSON value without its wall times, with peft's `target_modules` (a set, written in hash order) sorted and
    the digest of the adapter config that holds it left out."""
    if isinstance(row, dict):
        return {k: sorted(v) if k == "target_modules" and isinstance(v, list) else
                {**timeless(v), "sha256": None} if k.endswith("adapter_config.json") and isinstance(v, dict) else
                timeless(v) for k, v in row.items()
                if not (k.startswith("timing_s/") or k.endswith("_time") or k.endswith("/time") or k == "time")}
    if isinstance(row, list):
        return [timeless(v) for v in row]
    return row


def _json_rows(path: Path, root: Path):
    text = path.read_text().replace(str(root), "ROOT")
    if path.suffix == ".jsonl":
        return [timeless(json.loads(line)) for line in text.splitlines() if line.strip()]
    return timeless(json.loads(text))


def _safetensors(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key, value in list(meta.items()):
        try:
            parsed = json.loads(value)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            parsed.pop("run", None)
        meta[key] = parsed
    return tensors, meta


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


def compare_file(a: Path, b: Path, root_a: Path, root_b: Path) -> str | None:
    """None when the two files hold the same behaviour, else what differs."""
    if a.suffix in (".jsonl", ".json"):
        ra, rb = _json_rows(a, root_a), _json_rows(b, root_b)
        if _same(ra, rb):
            return None
        if isinstance(ra, list) and isinstance(rb, list):
            for i, (x, y) in enumerate(zip(ra, rb, strict=False)):
                if not _same(x, y):
                    keys = sorted(k for k in set(x) | set(y) if not _same(x.get(k), y.get(k))) \
                        if isinstance(x, dict) and isinstance(y, dict) else []
                    return f"row {i} differs: {keys[:8]}"
            return f"{len(ra)} rows against {len(rb)}"
        return "differs"
    if a.suffix == ".safetensors":
        (ta, ma), (tb, mb) = _safetensors(a), _safetensors(b)
        bad = sorted(k for k in set(ta) | set(tb) if not _same(ta.get(k), tb.get(k)))
        if bad:
            return f"tensors differ: {bad[:8]}"
        return None if _same(ma, mb) else f"metadata differs: {[k for k in ma if not _same(ma[k], mb.get(k))]}"
    if a.read_bytes() == b.read_bytes():
        return None
    if a.suffix in (".pt", ".bin"):
        return None if _same(torch.load(a, weights_only=False), torch.load(b, weights_only=False)) else "differs"
    try:
        same = a.read_text().replace(str(root_a), "ROOT") == b.read_text().replace(str(root_b), "ROOT")
    except UnicodeDecodeError:
        return "bytes differ"
    return None if same else "text differs"


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name not in SKIP_FILES
            and not p.name.endswith(SKIP_SUFFIXES) and "tmp" not in p.name}


def compare(a: Path, b: Path) -> int:
    """Print every difference between the job outputs `a` and `b`; the number of differences."""
    a, b = a.resolve(), b.resolve()
    fa, fb = _files(a), _files(b)
    problems = [f"only in {a}: {p}" for p in sorted(fa - fb)] + [f"only in {b}: {p}" for p in sorted(fb - fa)]
    for rel in sorted(fa & fb):
        why = compare_file(a / rel, b / rel, a, b)
        if why:
            problems.append(f"{rel}: {why}")
    print("\n".join(problems) if problems else f"identical: {len(fa)} files")
    return len(problems)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "run":
        run(Path(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return 1 if compare(Path(argv[1]), Path(argv[2])) else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
