"""Which compute dtype a device should train in: `model.dtype=auto` and `rollout.vllm_dtype=auto` resolved here.

bfloat16 mixed precision pays only where the hardware computes bfloat16 fast. On a CPU that depends on its
instructions: with AMX or AVX512-BF16, oneDNN multiplies bfloat16 matrices natively (2.5x the float32 rate on an
AMD EPYC with AVX512-BF16); with only AVX2 (most laptops and many cloud CPUs) it converts every element and runs
about 30x *slower* than float32 (docs/real-models.md, "Compute dtype"). A CUDA device computes bfloat16 fast when it
supports it at all (compute capability 8.0 and up).

The rule (`choose_dtype`):

- `float32` / `bfloat16` asked explicitly: that dtype; an explicit bfloat16 on a device where it is slow still
  runs, with a one-line warning giving the measured factor.
- `auto`: float32 for the embedded tiny model and the checkpoints saved from it
  (`models.tiny.is_tiny_model`; 64-wide matrices: bfloat16 saves nothing there, and the tiny
  presets' numbers then reproduce on every machine); otherwise bfloat16 where the device is fast
  in it, else float32.

On a CPU with native bfloat16 instructions the factor (bfloat16 matmul rate / float32 rate, one thread, a
SmolLM2-sized product) is measured once and cached under `$RLDYN_CACHE/hardware/` per CPU model and torch version;
"fast" means at least `FAST_FACTOR`. A CPU without them is slow by its instruction set and measured only to word
the warning of an explicit bfloat16.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

FAST_FACTOR = 1.2  # bfloat16 must beat float32 by this much to pay for autocast's casts
NATIVE_BF16 = ("AMX", "AVX512_BF16")  # CPU capabilities with bfloat16 matrix instructions
SHAPE = (128, 576, 1536)  # rows x in x out: one SmolLM2 MLP projection of a 128-token micro-batch


@dataclass(frozen=True)
class Bf16Speed:
    """How fast a device computes in bfloat16."""

    device: str  # "cpu" | "cuda"
    capability: str  # the CPU's best instruction set for it (AMX, AVX512_BF16, AVX512, AVX2, ...) or "cuda sm_XY"
    fast: bool  # bfloat16 mixed precision pays here
    factor: float | None = None  # measured bfloat16 / float32 matmul rate (None: not measured)

    def words(self) -> str:
        """`AVX512_BF16, bfloat16 matmul 2.51x float32` (what the console and environment.jsonl say)."""
        return self.capability + (f", bfloat16 matmul {self.factor:.2f}x float32" if self.factor is not None else "")


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved compute dtype and why."""

    name: str  # "float32" | "bfloat16"
    reason: str  # one clause, e.g. "auto: AVX2 has no fast bfloat16"
    warning: str | None = None  # a line to print (an explicit bfloat16 where it is slow)


def choose_dtype(key: str, requested: str, speed: Bf16Speed, *, tiny: bool = False) -> DtypeChoice:
    """Resolve `key=requested` (`model.dtype` or `rollout.vllm_dtype`: float32 | bfloat16 | auto) on a device of
    `speed`; `tiny`: the model is the embedded tiny one."""
    if requested == "float32":
        return DtypeChoice("float32", f"{key}=float32")
    if requested == "bfloat16":
        warning = None if speed.fast else (
            f"warning: {key}=bfloat16 on a device without fast bfloat16 ({speed.words()}): it will be slow; "
            f"{key}=auto computes in float32 here")
        return DtypeChoice("bfloat16", f"{key}=bfloat16", warning)
    if requested != "auto":
        raise ValueError(f"{key}={requested!r}: choose float32, bfloat16 or auto")
    if tiny:
        return DtypeChoice("float32", f"{key}=auto: the embedded tiny model computes in float32")
    if speed.fast:
        return DtypeChoice("bfloat16", f"{key}=auto: {speed.words()}")
    return DtypeChoice("float32", f"{key}=auto: no fast bfloat16 on this device ({speed.words()})")


def bf16_speed(device: torch.device, *, measure: bool = True, measure_slow: bool = False,
               cache_dir: Path | None = None) -> Bf16Speed:
    """The bfloat16 speed of `device` (see the module docstring). `measure=False`: the capability alone, nothing
    timed (fast = native instructions; for a choice that does not depend on it). `measure_slow`: measure the factor
    of a CPU without native bfloat16 too (to word a warning); it is never cached as fast."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return Bf16Speed("cuda", f"cuda sm_{major}{minor}", fast=torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return Bf16Speed(device.type, device.type, fast=False)
    capability = cpu_capability()
    native = capability in NATIVE_BF16
    if not measure or (not native and not measure_slow):
        return Bf16Speed("cpu", capability, fast=native)
    factor = _cached_factor(capability, cache_dir)
    return Bf16Speed("cpu", capability, fast=native and factor >= FAST_FACTOR, factor=factor)


def cpu_capability() -> str:
    """AMX or AVX512_BF16 where the CPU has bfloat16 matrix instructions, else torch's dispatch level (AVX512, AVX2,
    ...)."""
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512_BF16"
    return torch.backends.cpu.get_cpu_capability()


def cpu_model() -> str:
    """The CPU's model name (`AMD EPYC 9B14`), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_factor(repeats: int = 3) -> float:
    """bfloat16 / float32 rate of one `SHAPE` matrix product on one thread (best of `repeats` after a warm-up)."""
    rows, inner, out = SHAPE
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=generator), torch.randn(inner, out, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {dtype: _best_time(a.to(dtype), b.to(dtype), repeats) for dtype in (torch.float32, torch.bfloat16)}
    finally:
        torch.set_num_threads(threads)
    return seconds[torch.float32] / seconds[torch.bfloat16]


def _best_time(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    a @ b  # warm-up: oneDNN picks and packs its kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _cached_factor(capability: str, cache_dir: Path | None) -> float:
    """`matmul_factor`, measured once per CPU model, capability and torch version and kept in the cache."""
    from rldynamics.models.tiny import default_cache_dir

    key = hashlib.sha256(f"{cpu_model()}|{capability}|{torch.__version__}".encode()).hexdigest()[:16]
    path = (cache_dir or default_cache_dir()) / "hardware" / f"bf16-{key}.json"
    try:
        return float(json.loads(path.read_text())["factor"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    factor = matmul_factor()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"cpu": cpu_model(), "capability": capability, "torch": torch.__version__,
                                   "shape": list(SHAPE), "factor": factor}))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only means measuring again next time
    return factor
