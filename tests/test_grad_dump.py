"""Full gradient dumps: per-parameter arrays of every analysed gradient, written by a bounded background writer."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from rldynamics.config import make_config
from rldynamics.tracking.grad_dump import GradientDumper, GradientDumpError
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train


def test_training_run_dumps_every_analysed_gradient_per_parameter(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, "log.name=dump", "analysis.enabled=true", "analysis.every=1",
                                       "analysis.num_buckets=2", "algo.kl_coef=0.01", "algo.entropy_coef=0.01",
                                       "analysis.reward_grad=true", "analysis.dump_gradients=true",
                                       "analysis.dump_max_pending=1", "algo.adv_estimator=grpo", "train.steps=1",
                                       "val.every=0"]))
    rows = read_metrics(run)
    for step in (1,):
        folder = run / "analysis" / f"step_{step}"
        assert not list(folder.glob("*.tmp"))
        with np.load(folder / "gradients.npz") as dump:
            keys = set(dump.files)
            task = {k: dump[k] for k in keys if k.startswith("grad_norm/all/task/")}
            component = [k for k in keys if k.startswith("grad_norm/all/reward/solved/")]
        assert task and len(component) == len(task)  # one array per trainable parameter for each gradient
        assert any(k.endswith("embed_tokens.weight") for k in task)
        assert all(a.dtype == np.float32 for a in task.values())
        norm = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in task.values()))
        assert norm == pytest.approx(rows[step]["grad_norm/all/task"], rel=1e-5)
        assert "all" in {k.split("/")[1] for k in keys} <= {"all", "bucket_0", "bucket_1", "bucket_2"}


def test_a_failed_dump_is_raised_naming_the_file(tmp_path):
    dumper = GradientDumper(max_pending=2)
    dumper.submit(tmp_path / "gone" / "gradients.npz", {"a": np.zeros(3, dtype=np.float32)})
    with pytest.raises(GradientDumpError, match=r"gone/gradients\.npz could not be written"):
        dumper.close()


def test_a_dump_never_writes_through_a_link(tmp_path):
    """A link where the dump writes its temporary file is removed, never written through."""
    victims = []
    for name in (".gradients.npz.tmp", "gradients.npz.tmp"):
        victims.append(tmp_path / f"victim_{name}")
        victims[-1].write_text("precious")
        (tmp_path / name).symlink_to(victims[-1])
    dumper = GradientDumper(max_pending=1)
    dumper.submit(tmp_path / "gradients.npz", {"a": np.ones(3, dtype=np.float32)})
    dumper.close()
    assert all(v.read_bytes() == b"precious" for v in victims)
    with np.load(tmp_path / "gradients.npz") as dump:
        assert dump["a"].tolist() == [1.0, 1.0, 1.0]


class _Held:
    """An array element whose pickling (inside the writer's np.savez) waits until `release` is set."""

    def __init__(self, release: threading.Event):
        self.release = release

    def __reduce__(self):
        assert self.release.wait(timeout=60)
        return (int, (7,))


def test_writer_holds_at_most_max_pending_dumps(tmp_path):
    """With one slot, a second dump waits until the first is on disk."""
    release = threading.Event()
    dumper = GradientDumper(max_pending=1)
    dumper.submit(tmp_path / "first.npz", {"a": np.array([_Held(release)], dtype=object)})
    second = threading.Thread(target=dumper.submit, args=(tmp_path / "second.npz", {"b": np.ones(2)}))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive() and not (tmp_path / "first.npz").exists()  # waiting for the slot the first holds
    release.set()
    second.join(timeout=60)
    assert not second.is_alive()
    dumper.close()
    assert (tmp_path / "first.npz").exists()
    with np.load(tmp_path / "second.npz") as dump:
        assert dump["b"].tolist() == [1.0, 1.0]
