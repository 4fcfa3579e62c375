"""docs/health.md against the code of the rules: each rule's "Fires when" names every `health.*`
threshold its code reads and no other, states every fixed constant of the rule, and every number it
states is one of those constants or the default of a key it names (a "`health.<key>` (value)" pair:
that key's default); the Settings table holds every `health.*` key with its default and its
`--help-config` text."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from rldynamics.analysis.health_rules import RULES, Rule
from rldynamics.config import Config, HealthConfig, documented_keys

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "health.md").read_text()
DEFAULTS = HealthConfig()
ACTIONS = set(RULES)  # `health.<rule>`: an action, not a threshold
MONITOR = {"enabled", "layer_norms", "entropy_after_update", "max_rollbacks"}  # not a rule's
KNOBS = {f.name for f in dataclasses.fields(HealthConfig)} - ACTIONS - MONITOR
NUMBER = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?(?:e-?\d+)?)(\s*%)?(?![\w.])")
PAIR = re.compile(r"`health\.(\w+)` \(([\d.e-]+)\)")  # "`health.x` (value)"


def fires_when(rule: str) -> str:
    """The "Fires when" line of the rule's glossary entry in docs/health.md."""
    entry = PAGE[PAGE.index(f"#### `{rule}`\n"):]
    line = next(line for line in entry.splitlines() if line.startswith("- **Fires when.**"))
    return line.removeprefix("- **Fires when.**").strip()


def source_tree(cls: type[Rule]) -> ast.Module:
    return ast.parse(textwrap.dedent(inspect.getsource(cls)))


def knobs_read(cls: type[Rule]) -> set[str]:
    """The `health.*` fields the rule's code reads (`self.cfg.<field>`), that of the bases it shares
    with other rules included (`EntropyStart`)."""
    shared = [c for c in cls.__mro__ if issubclass(c, Rule) and c is not Rule]
    return {node.attr for c in shared for node in ast.walk(source_tree(c)) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"}


def constants(cls: type[Rule]) -> dict[str, float]:
    """The rule's fixed numbers: its own numeric class attributes."""
    return {k: v for k, v in vars(cls).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def literals(cls: type[Rule]) -> set[float]:
    """Numeric literals in the rule's methods."""
    methods = [n for n in source_tree(cls).body[0].body if isinstance(n, ast.FunctionDef)]
    return {node.value for m in methods for node in ast.walk(m) if isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)}


def numbers(text: str) -> list[float]:
    """The numbers the text states outside code spans (`25 %` is 0.25)."""
    prose = re.sub(r"`[^`]*`", "", text)
    return [float(n) / (100 if pct else 1) for n, pct in NUMBER.findall(prose)]


def named(text: str) -> set[str]:
    return set(re.findall(r"`health\.(\w+)`", text)) - ACTIONS


def among(value: float, values) -> bool:
    return any(value == pytest.approx(v, rel=1e-9) for v in values)


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_names_the_thresholds_its_code_reads(rule):
    assert named(fires_when(rule)) == knobs_read(RULES[rule]) & KNOBS, rule


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_states_its_constants_and_only_numbers_it_has(rule):
    text, cls = fires_when(rule), RULES[rule]
    stated, fixed = numbers(text), constants(cls)
    allowed = {0, *fixed.values(), *(getattr(DEFAULTS, k) for k in named(text))}  # 0: "~0", "> 0"
    assert all(among(n, allowed) for n in stated), (rule, stated, allowed)
    missing = [k for k, v in fixed.items() if not among(v, stated)]
    assert not missing, f"{rule}: the constants {missing} are not in docs/health.md"
    for key, value in PAIR.findall(text):  # "`health.x` (value)": x's default
        assert float(value) == pytest.approx(getattr(DEFAULTS, key), rel=1e-9), (rule, key, value)
    assert literals(cls) <= {0, 1}, f"{rule}: a number in its code that is no key nor constant"


def test_the_documented_first_step_and_grad_spike_conditions():
    first, spike = fires_when("first_step"), fires_when("grad_spike")
    assert "1e-4" not in first and "`health.first_step_kl` (5e-3)" in first
    assert "`health.grad_spike_factor` (20)" in spike and "`health.grad_spike_k` (10)" in spike


def test_docs_health_settings_rows_are_the_help_config_texts():
    keys = [(k, d, doc) for k, d, doc in documented_keys(Config()) if k.startswith("health.")]
    rows = {k: f"| `{k}` | `{d}` | {' '.join(doc.split())} |" for k, d, doc in keys}
    missing = [k for k, row in rows.items() if row not in PAGE]
    assert not missing, f"docs/health.md's Settings rows differ from --help-config: {missing}"
