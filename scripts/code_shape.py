"""Figures of the code's shape, counted from its syntax trees (nothing is run):

    python scripts/code_shape.py [ROOT]

- `config.py` lines and fields (annotated class attributes);
- hooks of the `Diagnostic` base class (its methods);
- functions taking a session without a type (a parameter `s` or `session` with no annotation);
- string-keyed reads of a step record (`meta[...]`, `tensors[...]`, `meta.get(...)`, `tensors.get(...)`) in the
  modules that read records (outside the format's own module);
- metric keys spelled as literals under `bench/` (strings whose first path segment is a metric section of
  `metric_names.py`);
- the share of source lines longer than 100 characters.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

# the modules that read records (the format's own module, tracking/step_records.py, is where its keys live)
RECORD_READERS = ("train/replay.py", "train/diagnostics/records.py", "plots/browser.py", "train/record_io.py")
SECTIONS = ("actor", "critic", "rollout", "val-env", "val-core", "health", "timing_s", "grad_norm", "grad_analysis",
            "reward_grad", "collapse", "response_length", "early_stopped", "env", "analysis", "record", "perf")


def _trees(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def untyped_sessions(src: Path) -> list[str]:
    out = []
    for path, tree in _trees(src):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.arg in ("s", "session") and a.annotation is None:
                        out.append(f"{path.relative_to(src)}:{node.name}")
    return out


def record_reads(src: Path) -> int:
    n = 0
    for rel in RECORD_READERS:
        path = src / rel
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("meta", "tensors") and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, str):
                n += 1
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("meta", "tensors"):
                n += 1
    return n


def bench_literals(bench: Path) -> list[str]:
    pattern = re.compile(rf"^({'|'.join(re.escape(s) for s in SECTIONS)})/[A-Za-z0-9_./<>-]+$")
    out = []
    for path, tree in _trees(bench):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                out.append(f"{path.name}:{node.value}")
    return out


def diagnostic_hooks(src: Path) -> int:
    tree = ast.parse((src / "train/diagnostics/base.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Diagnostic":
            return sum(isinstance(n, ast.FunctionDef) and n.name != "__init__" for n in node.body)
    return 0


def long_lines(src: Path) -> tuple[int, int]:
    lines = [line for path in src.rglob("*.py") for line in path.read_text().splitlines()]
    return sum(len(line) > 100 for line in lines), len(lines)


def config_shape(src: Path) -> tuple[int, int]:
    text = (src / "config.py").read_text()
    fields = sum(isinstance(n, ast.AnnAssign) for c in ast.walk(ast.parse(text)) if isinstance(c, ast.ClassDef)
                 for n in c.body)
    return len(text.splitlines()), fields


def main(root: Path) -> None:
    src = root / "src" / "rldynamics"
    lines, fields = config_shape(src)
    over, total = long_lines(src)
    untyped = untyped_sessions(src)
    literals = bench_literals(root / "bench")
    print(f"config.py: {lines} lines, {fields} fields")
    print(f"Diagnostic hooks: {diagnostic_hooks(src)}")
    print(f"functions with an untyped session: {len(untyped)}")
    print(f"string-keyed reads of a record: {record_reads(src)}")
    print(f"literal metric keys under bench/: {len(literals)} ({len(set(v.split(':')[1] for v in literals))} distinct)")
    print(f"source lines over 100 characters: {over} of {total} ({over / total:.1%})")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
