"""`rldyn plot` and `rldyn report` on one run directory, this checkout against another, alternating.

    python bench/figures.py RUN [--baseline-src DIR] [--rounds 3]

Each side draws RUN's figures (`plot_command`, into a directory of its own) and writes its report (`report_command`,
to a file of its own) in a fresh process, timed inside it, so the imports are left out. It prints the seconds of
each and a digest of the PNG files and of the images embedded in the report. With `--baseline-src` (another
checkout's `src/`) the two sides alternate for `--rounds` rounds, and the closing line gives baseline / ours of the
medians and whether the two drew the same bytes. RUN is only read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OURS = Path(__file__).resolve().parents[1] / "src"


def worker(run: Path, out: Path) -> None:
    """Time the figures and the report of `run`, written under `out`; print them as JSON with the digests."""
    from rldynamics.plots.cli import plot_command, report_command

    start = time.perf_counter()
    assert plot_command(run, out=out / "plots", list_files=False) == 0
    plot_s = time.perf_counter() - start
    start = time.perf_counter()
    assert report_command(run, out=out / "report.html", quiet=True) == 0
    report_s = time.perf_counter() - start
    pngs = sorted((out / "plots").glob("*.png"))
    files = hashlib.sha256(b"".join(p.read_bytes() for p in pngs)).hexdigest()
    images = re.findall(r"base64,([^\"]+)", (out / "report.html").read_text())
    embedded = hashlib.sha256("".join(images).encode()).hexdigest()
    print(json.dumps({"plot_s": plot_s, "report_s": report_s, "files": files[:12], "embedded": embedded[:12],
                      "pngs": len(pngs), "images": len(images)}))


def run_side(src: Path, run: Path) -> dict:
    """One side's figures and report of `run`, in a fresh process with `src` on the path."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, str(run), "--worker", out]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(src)}, check=True, capture_output=True,
                              text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run directory (only read)")
    parser.add_argument("--baseline-src", type=Path, help="another checkout's src/, run alternately with this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.run, args.worker)
    if not (args.run / "metrics.jsonl").is_file():
        parser.error(f"{args.run} is not a run directory (no metrics.jsonl): pass one that `rldyn train` wrote")
    sides = {"ours": OURS, **({"baseline": args.baseline_src.resolve()} if args.baseline_src else {})}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, src in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            res = run_side(src, args.run.resolve())
            results[name].append(res)
            print(f"round {r + 1} {name:8s} plot {res['plot_s']:6.2f} s  report {res['report_s']:6.2f} s  "
                  f"{res['pngs']} PNGs {res['files']}  {res['images']} embedded {res['embedded']}", flush=True)
    med = {name: {k: statistics.median(x[k] for x in rows) for k in ("plot_s", "report_s")}
           for name, rows in results.items()}
    for name, m in med.items():
        print(f"{name:8s} median: plot {m['plot_s']:.2f} s, report {m['report_s']:.2f} s, both "
              f"{m['plot_s'] + m['report_s']:.2f} s")
    if "baseline" in med:
        b, o = med["baseline"], med["ours"]
        same = {(x["files"], x["embedded"]) for rows in results.values() for x in rows}
        print(f"baseline / ours: plot {b['plot_s'] / o['plot_s']:.2f}x, report {b['report_s'] / o['report_s']:.2f}x, "
              f"both {(b['plot_s'] + b['report_s']) / (o['plot_s'] + o['report_s']):.2f}x; "
              f"{'the same' if len(same) == 1 else 'different'} bytes")


if __name__ == "__main__":
    main()
