"""Corrupt or foreign checkpoint files: one line naming the file and the problem, before any work, on resume and on
`rldyn probe`; and resuming honours the run's settings (refusing others) without touching config.yaml."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import FAST
from rldynamics.cli import main
from rldynamics.config import ConfigError, make_config
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.checkpoint import MANIFEST, CheckpointError, remove_stale, save_checkpoint, verify_checkpoint
from rldynamics.train.probe import probe_checkpoint
from rldynamics.train.trainer import train


@pytest.fixture(scope="module")
def trained(tiny_cache, tmp_path_factory) -> Path:
    """A 2-step GAE run (critic included) with checkpoints at steps 1 and 2; tests work on copies."""
    root = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLDYN_CACHE", tiny_cache)
        return train(make_config(overrides=[*FAST, f"log.run_dir={root}", "log.name=run", "checkpoint.every=1",
                                            "algo.adv_estimator=gae"]))


@pytest.fixture
def run(trained, tmp_path, monkeypatch, tiny_cache) -> Path:
    """A private copy of the trained run."""
    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    return Path(shutil.copytree(trained, tmp_path / "runs" / "run"))


def _overrides(run: Path) -> list[str]:
    return [*FAST, f"log.run_dir={run.parent}", "log.name=run", "checkpoint.every=1", "algo.adv_estimator=gae"]


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run directory (except the checkpoints) with its content."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and "checkpoints" not in p.parts}


def _rewrite_manifest(ckpt: Path) -> None:
    """Make the manifest agree with the files again: a foreign checkpoint whose checksums are consistent."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for rel in manifest["files"]:
        data = (ckpt / rel).read_bytes()
        manifest["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _truncate(rel: str, keep: float = 0.5) -> Callable[[Path], str]:
    def go(ckpt: Path) -> str:
        data = (ckpt / rel).read_bytes()
        (ckpt / rel).write_bytes(data[: int(len(data) * keep)])
        return rel
    return go


def _flip(rel: str, where: float) -> Callable[[Path], str]:
    def go(ckpt: Path) -> str:
        data = bytearray((ckpt / rel).read_bytes())
        data[int(len(data) * where)] ^= 0x40
        (ckpt / rel).write_bytes(bytes(data))
        return rel
    return go


def _foreign_state(edit: Callable[[dict], object]) -> Callable[[Path], str]:
    def go(ckpt: Path) -> str:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        (ckpt / "trainer_state.json").write_text(json.dumps(edit(state)))
        _rewrite_manifest(ckpt)
        return "trainer_state.json"
    return go


def _text(rel: str, text: str, manifest: bool = True) -> Callable[[Path], str]:
    def go(ckpt: Path) -> str:
        (ckpt / rel).write_text(text)
        if manifest:
            _rewrite_manifest(ckpt)
        return rel
    return go


def _wrong_shape_optimizer(ckpt: Path) -> str:
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    state = optim["actor"]["state"]
    first = next(iter(state))
    state[first]["exp_avg"] = torch.zeros(3, 5)
    torch.save(optim, ckpt / "optimizer.pt")
    _rewrite_manifest(ckpt)
    return "optimizer.pt"


def _other_model_optimizer(ckpt: Path) -> str:
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    optim["actor"]["param_groups"][0]["params"] = optim["actor"]["param_groups"][0]["params"][:-2]
    torch.save(optim, ckpt / "optimizer.pt")
    _rewrite_manifest(ckpt)
    return "optimizer.pt"


def _pickled_code(ckpt: Path) -> str:
    import pickle

    class Boom:
        def __reduce__(self):
            return (print, ("this must never run",))

    (ckpt / "rng.pt").write_bytes(pickle.dumps({"torch": Boom()}))
    _rewrite_manifest(ckpt)
    return "rng.pt"


def _wrong_rng(ckpt: Path) -> str:
    torch.save({"torch": torch.zeros(7, dtype=torch.uint8)}, ckpt / "rng.pt")
    _rewrite_manifest(ckpt)
    return "rng.pt"


def _no_critic(ckpt: Path) -> str:
    shutil.rmtree(ckpt / "critic")
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("critic/")}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    return MANIFEST


def _remove(rel: str) -> Callable[[Path], str]:
    def go(ckpt: Path) -> str:
        (ckpt / rel).unlink()
        return rel
    return go


# name -> (damage the checkpoint, returning the file the message must name; words the message must contain)
DAMAGE = {
    "weights truncated": (_truncate("actor/model.safetensors"), "truncated"),
    "weights empty": (_truncate("actor/model.safetensors", 0.0), "empty"),
    "weights bit flip in data": (_flip("actor/model.safetensors", 0.9), "checksum mismatch"),
    "weights bit flip in header": (_flip("actor/model.safetensors", 0.0), "safetensors"),
    "optimizer truncated": (_truncate("optimizer.pt", 0.7), "truncated"),
    "rng truncated": (_truncate("rng.pt", 0.3), "truncated"),
    "rng state of another size": (_wrong_rng, "RNG state"),
    "rng holds pickled code": (_pickled_code, "cannot be read as tensors"),
    "trainer state malformed": (_text("trainer_state.json", '{"step": 2, '), "not valid JSON"),
    "trainer state without step": (_foreign_state(lambda s: {"early_stop": s["early_stop"]}), "'step'"),
    "trainer state step is text": (_foreign_state(lambda s: {**s, "step": "2"}), "'step'"),
    "trainer state not an object": (_foreign_state(lambda s: [s]), "JSON object"),
    "early-stop state foreign": (_foreign_state(lambda s: {**s, "early_stop": {"x": 1}}), "early-stop state"),
    "trainer state edited": (_text("trainer_state.json", '{"step": 1, "early_stop": {}}', manifest=False), "bytes"),
    "optimizer state of other shape": (_wrong_shape_optimizer, "shape"),
    "optimizer state of another model": (_other_model_optimizer, "parameters"),
    "manifest missing": (_remove(MANIFEST), "missing"),
    "manifest malformed": (_text(MANIFEST, "[1, 2", manifest=False), "malformed"),
    "weights missing": (_remove("actor/model.safetensors"), "missing"),
    "critic missing": (_no_critic, "critic"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_checkpoint_is_one_line_before_any_work(run, case):
    ckpt = run / "checkpoints" / "step_2"
    damage, words = DAMAGE[case]
    named = ckpt / damage(ckpt)
    before = _snapshot(run)
    for attempt in (lambda: train(make_config(overrides=[*_overrides(run), "checkpoint.resume=latest",
                                                         "train.steps=3"])),
                    lambda: probe_checkpoint(ckpt, ["log.name=probe"])):
        with pytest.raises(CheckpointError) as e:
            attempt()
        message = str(e.value)
        assert "\n" not in message and str(named) in message and words in message, message
        assert _snapshot(run) == before  # config.yaml, rows, samples untouched
        assert not (run.parent / "probe").exists()  # the probe wrote nothing either


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_checkpoint_path_that_is_not_a_directory(run, kind, capsys):
    path = run / "checkpoints" / "step_9"
    if kind == "file":
        path.write_text("not a checkpoint")
    for argv in (["train", f"checkpoint.resume={path}"], ["probe", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err
        assert ("does not exist" if kind == "missing" else "is a file") in err


def test_resume_refuses_other_settings_and_keeps_config(run):
    before = _snapshot(run)
    with pytest.raises(ConfigError, match=r"train\.lr \(run: 0\.0003, given: 0\.01\).*algo\.kl_coef") as e:
        train(make_config(overrides=[*_overrides(run), "checkpoint.resume=latest", "train.lr=0.01",
                                     "algo.kl_coef=0.5"]))
    assert "\n" not in str(e.value)
    assert _snapshot(run) == before


def test_cli_resume_continues_with_the_saved_settings(run, capsys):
    """`rldyn train log.name=run checkpoint.resume=latest train.steps=3`: the run's own settings (not the preset's),
    a longer run recorded in config.yaml; a changed learning rate is refused and config.yaml stays as it was."""
    common = ["train", f"log.run_dir={run.parent}", "log.name=run", "checkpoint.resume=latest"]
    saved = (run / "config.yaml").read_bytes()
    assert main([*common, "train.lr=0.01"]) == 2
    assert "train.lr" in capsys.readouterr().err
    assert (run / "config.yaml").read_bytes() == saved
    assert main([*common, "train.steps=3"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    cfg = make_config(None, run / "config.yaml")
    assert cfg.train.steps == 3 and cfg.train.env_groups == 2 and cfg.algo.adv_estimator == "gae"
    assert cfg.train.lr == make_config(overrides=FAST).train.lr


def test_checkpoint_writes_never_follow_links(tmp_path):
    """Links where a checkpoint is written or removed (its temporary directory, the `step_<N>` it replaces, an older
    checkpoint beyond keep_last, a stale temporary directory) are removed as links: what they point to is untouched."""
    tokenizer = build_tiny_tokenizer(["<answer>Up || Left</answer>", "Turn 1: ####"])
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, intermediate_size=64)
    directory = tmp_path / "run" / "checkpoints"
    directory.mkdir(parents=True)
    victims = []
    for name in (f".tmp_step_1_{os.getpid()}", "step_1", "step_0", ".tmp_step_0_1"):
        victims.append(tmp_path / "victims" / name)
        victims[-1].mkdir(parents=True)
        (victims[-1] / "keep").write_text("precious")
        (directory / name).symlink_to(victims[-1], target_is_directory=True)
    path = save_checkpoint(directory, 1, model=model, tokenizer=tokenizer, optimizer=torch.optim.AdamW(
        model.parameters()), trainer_state={"early_stop": {}}, keep_last=1)
    remove_stale(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["step_1"] and not path.is_symlink()
    assert verify_checkpoint(path)["step"] == 1
    assert all([p.name for p in v.iterdir()] == ["keep"] for v in victims)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last_one(tmp_path, monkeypatch):
    """A write that fails inside a checkpoint (here torch.save failing as it does on a full disk) ends in one line
    naming the checkpoint and the last complete one, which is still there; no temporary directory is left."""
    tokenizer = build_tiny_tokenizer(["<answer>Up || Left</answer>", "Turn 1: ####"])
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, intermediate_size=64)
    optimizer = torch.optim.AdamW(model.parameters())
    directory = tmp_path / "run" / "checkpoints"
    state = {"early_stop": {}}
    first = save_checkpoint(directory, 1, model=model, tokenizer=tokenizer, optimizer=optimizer, trainer_state=state)

    def disk_full(*args, **kwargs):  # what torch.save raises when the disk fills up under it
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError) as e:
        save_checkpoint(directory, 2, model=model, tokenizer=tokenizer, optimizer=optimizer, trainer_state=state)
    message = str(e.value)
    assert "\n" not in message and f"{directory / 'step_2'} could not be written" in message
    assert f"the last complete checkpoint, {first}, is still there" in message and "unexpected pos" in message
    assert sorted(p.name for p in directory.iterdir()) == ["step_1"] and verify_checkpoint(first)["step"] == 1


def test_the_start_up_line_says_what_the_checkpoints_take_and_a_checkpoint_takes_that(fast_overrides, capsys):
    """With the progress lines off, the run still says how many checkpoints its schedule keeps and their size; the
    size is what a checkpoint on disk holds (weights and two AdamW moments; the tokenizer and JSON files are small)."""
    run = train(make_config(overrides=[*fast_overrides, "checkpoint.every=1", "checkpoint.keep_last=0"]))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("checkpoints: "))
    count, each, total = (float(x) for x in re.match(r"checkpoints: (\d+) of about ([\d.]+) MiB each kept at "
                                                       r"most \(([\d.]+) MiB", line).groups())
    on_disk = [sum(f.stat().st_size for f in step.rglob("*") if f.is_file()) / 2**20
               for step in sorted((run / "checkpoints").iterdir())]
    assert count == len(on_disk) == 2 and abs(total - 2 * each) <= 0.01
    assert all(abs(mb - each) <= 0.05 * mb for mb in on_disk), (line, on_disk)
