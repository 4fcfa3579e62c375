"""The README and the docs/ pages: short README, every page reachable, every link and anchor resolves, every file
path they name exists, and every `rldyn` command they show parses and (for train) names valid settings."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rldynamics.cli import parse_args
from rldynamics.config import make_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:src|tests|bench|scripts|docs)/[\w./-]+)`")
FENCE = re.compile(r"^```")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, in_fence = set(), False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(re.sub(r"`[^`\n]*`", "", page.read_text()))  # not inside inline code


def test_readme_is_a_short_guide_that_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {(ROOT / target.split("#")[0]).resolve() for target in links(ROOT / "README.md")}
    unlinked = [p.relative_to(ROOT) for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages not linked from the README: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    assert not broken, broken


OWN_PAGES = [p for p in PAGES if "reference" not in p.relative_to(ROOT).parts]  # reference notes name peers' files


@pytest.mark.parametrize("page", OWN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repository_files_exist(page):
    missing = [p for p in CODE_PATH.findall(page.read_text()) if "<" not in p and not (ROOT / p).exists()]
    assert not missing, missing


def commands(page: Path) -> list[str]:
    """The `rldyn ...` lines of the page's code blocks (indented or fenced), continuation lines joined, comments
    and lines with placeholders (`<run>`, `$VAR`, `...`) left out."""
    out, lines, in_fence = [], page.read_text().splitlines(), False
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_fence = not in_fence
        code = in_fence or line.startswith("    ")
        text = line.strip()
        if code and text.startswith("rldyn "):
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            text = text.split(" # ")[0].split("  #")[0].strip()
            for part in text.split(" && "):
                if not re.search(r"[<$]|\.\.\.|\[key=value|\[--", part) and part.startswith("rldyn "):
                    out.append(part)
        i += 1
    return out


ALL_COMMANDS = [(page, c) for page in PAGES for c in commands(page)]


def test_the_docs_show_commands():
    assert len(ALL_COMMANDS) >= 20


@pytest.mark.parametrize("page,command", ALL_COMMANDS,
                         ids=[f"{p.relative_to(ROOT)}:{c[:60]}" for p, c in ALL_COMMANDS])
def test_documented_commands_parse(page, command):
    argv = shlex.split(command)[1:]
    args = parse_args(argv)  # exits (SystemExit) on an unknown option or sub-command
    paths_elsewhere = any(v.startswith("/") and not Path(v).exists()  # /models/..., /data/...: the reader's files
                          for v in (o.partition("=")[2] for o in getattr(args, "overrides", [])))
    if args.command == "train" and not args.help_config and not args.config and not paths_elsewhere:
        make_config(args.preset or "sokoban-tiny", args.config, args.overrides)  # names a bad key or value
