"""The report's sample browser (`plots/browser.py`) on the records of a real two-step run of the embedded tiny model:
a selector entry, histograms and a data blob per recorded step, every reply's text in the blobs, the solve-all /
solve-none shares of the record, values as recorded, a damaged record as one line, a hand-written attribution.json,
and the page's script building the token spans in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from conftest import FAST
from rldynamics.config import make_config
from rldynamics.plots.browser import compact, decode_indexes, encode_indexes, run_lengths, solve_shares
from rldynamics.plots.report import build_report
from rldynamics.tracking.run_dir import read_events
from rldynamics.tracking.step_records import read_record, record_path, write_record
from rldynamics.train.trainer import train

STEPS = (1, 2)


@pytest.fixture(scope="module")
def recorded(tiny_cache, tmp_path_factory) -> Path:
    """A 2-step run recording both steps; tests work on copies."""
    root = tmp_path_factory.mktemp("recorded")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLDYN_CACHE", tiny_cache)
        return train(make_config(overrides=[*FAST, f"log.run_dir={root}", "log.name=run", "record.every=1"]))


@pytest.fixture
def run(recorded, tmp_path) -> Path:
    return Path(shutil.copytree(recorded, tmp_path / "run"))


def _blobs(page: str) -> dict[str, dict]:
    return {m[1]: json.loads(m[2]) for m in re.finditer(r'<script type="application/json" id="([^"]+)">(.*?)</script>',
                                                         page, re.S)}


def _reply_text(tensors: dict, meta: dict, i: int) -> str:
    """Row i's tokens from its first response token to its last attended one, decoded piece by piece."""
    attended = np.flatnonzero(tensors["attention_mask"][i])
    start = int(np.flatnonzero(tensors["response_mask"][i])[0])
    return "".join(meta["pieces"][str(t)] for t in tensors["input_ids"][i, start:attended[-1] + 1].tolist())


def _edit(run: Path, step: int, edit) -> None:
    """Rewrite the record of `step` with `edit(tensors, meta)` applied."""
    tensors, meta = read_record(record_path(run, step))
    edit(tensors, meta)
    write_record(run, step, tensors, meta)


def test_the_report_has_an_entry_histograms_and_a_blob_per_recorded_step(recorded):
    page = build_report(recorded)
    blobs = _blobs(page)
    labels = dict(re.findall(r'<option value="(\d+)"[^>]*>([^<]*)</option>', page))
    assert list(labels) == [str(s) for s in STEPS] and all(labels[str(s)].startswith(f"step {s} (every") for s in STEPS)
    for event in read_events(recorded):  # a record.on_alarm reason: the rules that started firing on the step
        assert f"alarm: {event['rule']}" in labels[str(event["step"])]
    for step in STEPS:
        block = page[page.index(f'id="bstep-{step}"'):]
        block = block[:block.index("</div>", block.index('class="bgroups"'))]
        assert block.count('<img alt="Step') == 1 and "data:image/png;base64," in block
        assert f"bdata-{step}" in blobs and blobs[f"bdata-{step}"]["step"] == step
    assert "Sample trajectories" not in page  # the browser replaces the few decoded samples


def test_every_reply_and_prompt_is_in_the_step_blob(recorded):
    blobs = _blobs(build_report(recorded))
    table = blobs["bpieces"]
    assert len(set(table["ids"])) == len(table["ids"]) == len(table["text"])
    for step in STEPS:
        tensors, meta = read_record(record_path(recorded, step))
        data = blobs[f"bdata-{step}"]
        decoded = lambda s: "".join(table["text"][k] for k in decode_indexes(s))  # noqa: E731
        assert len(data["rows"]) == len(tensors["scores"])
        for i, row in enumerate(data["rows"]):
            assert row["i"] == i and decoded(row["t"]) == _reply_text(tensors, meta, i)
        groups = {int(g): [i for i, h in enumerate(tensors["group_ids"].tolist()) if h == g]
                  for g in dict.fromkeys(tensors["group_ids"].tolist())}
        assert [(g["g"], g["rows"]) for g in data["groups"]] == list(groups.items())
        for g in data["groups"]:
            first = g["rows"][0]
            start = int(np.flatnonzero(tensors["response_mask"][first])[0])
            prompt = "".join(meta["pieces"][str(t)] for t in tensors["input_ids"][first, :start].tolist())
            assert decoded(g["p"]) == prompt and prompt.count("<|im_start|>") >= 2


def test_solve_shares_are_the_records_counts(run):
    def successes(tensors, meta):  # group 0: every row succeeds; group 1: one row of two
        for i, g in enumerate(tensors["group_ids"].tolist()):
            meta["env_metrics"][i]["success"] = 1.0 if g == 0 or i % 2 else 0.0

    _edit(run, 2, successes)
    page = build_report(run)
    for step in STEPS:
        tensors, meta = read_record(record_path(run, step))
        ok = {}
        for g, m in zip(tensors["group_ids"].tolist(), meta["env_metrics"], strict=True):
            ok.setdefault(g, []).append(m["success"] > 0)
        solved_all, solved_none = sum(all(v) for v in ok.values()), sum(not any(v) for v in ok.values())
        block = page[page.index(f'id="bstep-{step}"'):page.index('class="bgroups"', page.index(f'id="bstep-{step}"'))]
        assert (f"solve-all {solved_all} of {len(ok)} groups ({solved_all / len(ok):.1%}) · "
                f"solve-none {solved_none} of {len(ok)} ({solved_none / len(ok):.1%})") in block
    assert "solve-all 1 of 2 groups (50.0%) · solve-none 0 of 2 (0.0%)" in page


def test_values_are_the_records_and_dropped_rows_have_none(run):
    def keep_group_0(tensors, meta):
        kept = np.flatnonzero(tensors["group_ids"] == tensors["group_ids"][0])
        for key in ("advantages", "trainer_logprobs", "entropy"):
            tensors[key] = tensors[key][kept]
        tensors["kept_rows"] = kept
        tensors["advantages"] = np.where(tensors["response_mask"][kept] > 0, np.arange(len(kept))[:, None] - 0.5,
                                         0.0).astype(np.float32)

    _edit(run, 1, keep_group_0)
    tensors, meta = read_record(record_path(run, 1))
    data = _blobs(build_report(run))["bdata-1"]
    kept = tensors["kept_rows"].tolist()
    assert 0 < len(kept) < len(data["rows"])
    for i, row in enumerate(data["rows"]):
        mask = tensors["response_mask"][i] > 0
        assert row["lp"] == compact(tensors["rollout_logprobs"][i][mask])
        if i not in kept:
            assert row["k"] == 0 and row["a"] is None and not {"adv", "ent", "mis"} & set(row)
            continue
        k = kept.index(i)
        assert row["k"] == 1 and row["a"] == float(f"{k - 0.5:.3g}") == row["adv"]  # one value for the reply
        assert row["ent"] == compact(tensors["entropy"][k][mask])
        assert row["mis"] == compact(tensors["rollout_logprobs"][i][mask] - tensors["trainer_logprobs"][k][mask])
        assert sum(row["s"][::2]) == int(mask.sum())


def test_a_damaged_record_is_one_line_and_the_rest_of_the_report_stays(run):
    path = record_path(run, 1)
    path.write_bytes(path.read_bytes()[:200])
    page = build_report(run)
    notes = re.findall(r"<li>(records/step_1\.safetensors: [^<]*)</li>", page)
    assert len(notes) == 1 and notes[0].endswith("; skipped") and "not a readable step record" in notes[0]
    assert '<option value="1"' not in page and '<option value="2"' in page and "bdata-2" in page
    assert 'id="config"' in page and 'id="health"' in page


def test_no_readable_record_keeps_the_decoded_samples(run):
    for step in STEPS:
        record_path(run, step).write_bytes(b"not a record")
    page = build_report(run)
    assert page.count("; skipped</li>") == 2 and 'id="browser"' not in page and "Training rollouts of steps" in page


def _attribution(run: Path) -> dict:
    tensors, _ = read_record(record_path(run, 2))
    rows = tensors["kept_rows"].tolist()
    shares = np.linspace(-0.2, 1.0, len(rows))
    shares = shares / shares.sum()
    first = int(np.flatnonzero(tensors["response_mask"][rows[-1]])[0])
    return {"step": 2, "grad_norm": 0.5,
            "rows": [{"row": r, "group": int(tensors["group_ids"][r]), "share": float(s), "cosine": 0.1 * n,
                      "norm": 0.01} for n, (r, s) in enumerate(zip(rows, shares, strict=True))],
            "groups": [{"group": int(g), "share": 0.5, "cosine": None, "norm": 0.02}
                       for g in dict.fromkeys(tensors["group_ids"].tolist())],
            "tokens": {str(rows[-1]): [[first, 0.25], [first + 1, -0.125]]}}


def test_attribution_json_is_shown_when_present(run):
    attribution = _attribution(run)
    folder = run / "replays" / "step_2"
    folder.mkdir(parents=True)
    (folder / "attribution.json").write_text(json.dumps(attribution))
    page = build_report(run)
    blobs = _blobs(page)
    assert blobs["bdata-2"]["hasAt"] and not blobs["bdata-1"]["hasAt"]
    top = max(attribution["rows"], key=lambda r: abs(r["share"]))
    row = blobs["bdata-2"]["rows"][top["row"]]
    assert row["top"] == 1 and row["sh"] == float(f"{top['share']:.3g}") and row["at"] == attribution["tokens"][
        str(top["row"])]
    assert f'href="#br-2-{top["row"]}"' in page and "replays/step_2/attribution.json" in page
    assert blobs["bdata-2"]["groups"][blobs["bdata-2"]["open"]]["g"] == top["group"]
    (folder / "attribution.json").write_text("{not json")
    page = build_report(run)
    assert "replays/step_2/attribution.json: not readable (JSONDecodeError" in page and "bdata-2" in page


def test_token_strings_runs_and_values_by_hand():
    indexes = [0, 31, 32, 1023, 1024, 5, 10**6]
    assert encode_indexes([0, 31, 32]) == "0VX0" and decode_indexes(encode_indexes(indexes)) == indexes
    assert run_lengths(np.array([1, 1, 0, 0, 0, 1], bool)) == [2, 3, 1] and run_lengths(np.array([0, 1], bool)) == [
        0, 1, 1]
    assert compact(np.array([0.123456, 0.123456])) == 0.123 and compact(np.array([1.0, np.inf])) == [1.0, None]
    shares = solve_shares(np.array([0, 0, 1, 1, 2, 2]), np.array([1, 1, 0, 1, 0, 0], bool))
    assert (shares.groups, shares.solve_all, shares.solve_none) == (3, 1, 1)
    assert shares.text() == "solve-all 1 of 3 groups (33.3%) · solve-none 1 of 3 (33.3%)"


def _chromium(args: list[str], page: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
                           *args, f"file://{page}"], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_the_page_builds_the_spans_of_the_shown_step_in_headless_chromium(run, tmp_path):
    def signed(tensors, meta):  # advantages of both signs, so both colours are drawn
        kept = len(tensors["kept_rows"])
        tensors["advantages"] = np.where(tensors["response_mask"][tensors["kept_rows"]] > 0,
                                         np.where(np.arange(kept) % 2, 1.0, -1.0)[:, None], 0.0).astype(np.float32)

    for step in STEPS:
        _edit(run, step, signed)
    page = run / "report.html"
    page.write_text(build_report(run), encoding="utf-8")
    done = _chromium(["--virtual-time-budget=5000", "--dump-dom"], page, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Uncaught" not in done.stderr, [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    dom, text = done.stdout, page.read_text(encoding="utf-8")
    shown = int(re.search(r'<option value="(\d+)" selected>', text)[1])  # the last step unless one alarmed
    other = ({*STEPS} - {shown}).pop()
    data = _blobs(text)[f"bdata-{shown}"]
    tensors, _ = read_record(record_path(run, shown))
    opened = data["groups"][data["open"]]["rows"]
    assert f'<div class="bstep" id="bstep-{shown}">' in dom and f'id="bstep-{other}" hidden' in dom
    assert dom.count('class="tok"') == int(tensors["response_mask"][opened].sum()) > 0
    assert all(f'id="br-{shown}-{i}"' in dom for i in opened) and f'id="br-{other}-' not in dom  # the chosen step
    assert "rgba(33, 102, 172" in dom and "rgba(214, 39, 40" in dom
    shot = tmp_path / "shot.png"
    done = _chromium(["--window-size=1400,4000", f"--screenshot={shot}"], page, tmp_path)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    image = imread(str(shot))
    assert image.shape[0] > 100 and float(image[..., :3].std()) > 0.01


def test_every_figure_states_its_size(run):
    page = build_report(run)
    images = re.findall(r"<img [^>]*>", page)
    assert images and all(re.search(r'width="\d+" height="\d+"', img) for img in images)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_a_link_to_the_samples_lands_on_them_in_headless_chromium(run, tmp_path):
    """The page is scrolled to the section once it is built. (Headless chromium's --screenshot of any scrolled page,
    a plain one included, comes out blank: the position is read from the page itself.)"""
    probe = ("<script>window.addEventListener('load', () => setTimeout(() => document.body.setAttribute("
             "'data-probe', scrollY + ',' + Math.round(document.getElementById('samples').getBoundingClientRect()"
             ".top)), 200));</script></body>")
    page = run / "probe.html"
    page.write_text(build_report(run).replace("</body>", probe), encoding="utf-8")
    done = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900",
                           "--virtual-time-budget=5000", "--dump-dom", f"file://{page}#samples"],
                          capture_output=True, text=True, timeout=120)
    scrolled, top = map(int, re.search(r'data-probe="(-?\d+),(-?\d+)"', done.stdout).groups())
    assert scrolled > 0 and abs(top) <= 1
