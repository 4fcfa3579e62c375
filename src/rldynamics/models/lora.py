"""LoRA adapters on the actor (peft): adding them, the frozen base as the KL reference, adapter files, merged export.

Design choices:

- `model.lora.rank > 0` wraps the loaded actor with peft (`add_adapters`: `get_peft_model`, a
  `PeftModelForCausalLM`). The base weights are frozen; only the adapters' A and B matrices train, in float32 like
  every trained weight (`models.precision`: mixed precision computes in bfloat16 around them), and the optimizer is
  given those alone (`trainable`). Which modules get adapters is peft's `all-linear` by default: every linear layer
  but the output layer, whatever the architecture calls them.
- The KL reference of a LoRA run is the actor itself with its adapters switched off (`as_reference`): exactly the
  base weights, with no second copy of the model in memory.
- peft's wrapper takes `**kwargs` and hands them to the transformers model, so code that reads a model's forward
  signature (the cache keyword, `logits_to_keep`) reads the model underneath (`underlying`).
- A checkpoint's `actor/` holds the adapter in peft's own format (`adapter_config.json`, `adapter_model.safetensors`:
  `PeftModel.from_pretrained(base, path)` loads it); `load_adapter` puts it back on the run's base model. The merged
  export (`merged_state_dict`) computes W + scale x B A into new tensors and never merges in place: merging and
  unmerging in place would leave the base weights changed by float rounding. The vLLM engine samples the same merged
  weights (`merged_weights`, under the base's parameter names), synced after every optimizer step.
- The adapters' dropout (`model.lora.dropout`) is on only inside `adapter_dropout`, which the actor update enters
  with a seed of its step: every model here stays in eval mode otherwise, so rollouts, log-prob passes and the
  analysis see whole adapters, and a resume or a replay of the step draws the same masks.
- peft is optional (the `lora` extra) and imported only where adapters are used; `is_adapted` never imports it.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from rldynamics import dist

ADAPTER_CONFIG = "adapter_config.json"  # peft's file: a directory holding it is an adapter, not a whole model
INSTALL = "pip install -e '.[lora]' (or pip install peft)"
PEFT_PREFIX = "base_model.model."  # a peft model's state dict names = this + its base model's names


def check_installed(rank: int) -> None:
    """ModuleNotFoundError naming the install line when `model.lora.rank` > 0 and peft is not importable."""
    if rank > 0 and importlib.util.find_spec("peft") is None:
        raise ModuleNotFoundError(f"model.lora.rank={rank} needs peft, which is not installed: {INSTALL}")


def _peft():
    """The peft package (ModuleNotFoundError with the install line when it is missing)."""
    if importlib.util.find_spec("peft") is None:
        raise ModuleNotFoundError(f"LoRA adapters need peft, which is not installed: {INSTALL}")
    import peft

    return peft


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (an actor with adapters). Never imports peft: no model is one before it is."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def underlying(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose forward a call finally runs: a peft model's base model (its adapters inside),
    any other model itself. Read its signature, not the wrapper's (`**kwargs`)."""
    return model.get_base_model() if is_adapted(model) else model


def is_adapter_dir(path: str | Path) -> bool:
    """Whether the directory `path` holds a peft adapter (`adapter_config.json`) rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def add_adapters(model: torch.nn.Module, rank: int, alpha: int, dropout: float,
                 target_modules: list[str]) -> torch.nn.Module:
    """`model` wrapped with fresh LoRA adapters (B = 0: the adapted model starts equal to the base; A drawn from the
    global torch RNG, then rank 0's on every rank under torchrun), base weights frozen, in eval mode.

    Raises ValueError when `rank` is above the width of an adapted layer (`check_rank`), a target
    module names nothing in the model, or adapts a weight the model ties to another (a tied LM head:
    the adapter would change the output layer without the input embedding, and no merged export
    could keep the tie)."""
    peft = _peft()
    check_rank(model, rank, target_modules)
    targets = target_modules[0] if target_modules == ["all-linear"] else list(target_modules)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                             task_type="CAUSAL_LM")
    tied = _tied_parameters(model)
    adapted = peft.get_peft_model(model, config)
    shared = [name for name, module in adapted.get_base_model().named_modules()
              if isinstance(module, peft.tuners.lora.LoraLayer) and id(module.get_base_layer().weight) in tied]
    if shared:
        raise ValueError(f"model.lora.target_modules={target_modules} adapts {shared[0]}, whose weight the model ties "
                         "to another module (a tied LM head); leave it out (all-linear does)")
    _same_on_every_rank(trainable(adapted))
    return adapted.eval()


def check_rank(model: torch.nn.Module, rank: int, target_modules: list[str]) -> None:
    """ValueError naming the rank, the width and the module when `rank` is above min(inputs,
    outputs) of a layer the targets adapt: B A has rank at most that there, so the excess only costs
    memory and time. Checked before any adapter is allocated."""
    layers = [(name, min(m.weight.shape)) for name, m in _targeted(model, target_modules)]
    name, width = min(layers, key=lambda layer: layer[1], default=("", rank))
    if rank > width:
        raise ValueError(f"model.lora.rank={rank} is above the width of the narrowest adapted "
                         f"layer, {width} ({name}): an adapter's update has rank at most {width} "
                         f"there; set model.lora.rank <= {width} or leave "
                         f"{name.rpartition('.')[2]} out of model.lora.target_modules")


def _targeted(model: torch.nn.Module, targets: list[str]) -> list[tuple[str, torch.nn.Module]]:
    """The layers peft adapts: all-linear, every linear layer but the output layer; else those
    whose name is a target or ends with `.<target>`."""
    from transformers.pytorch_utils import Conv1D

    modules = list(model.named_modules())
    if targets == ["all-linear"]:
        head = model.get_output_embeddings()
        return [(n, m) for n, m in modules
                if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head]
    return [(n, m) for n, m in modules
            if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
            and any(n == t or n.endswith(f".{t}") for t in targets)]


def _same_on_every_rank(params: list[torch.nn.Parameter]) -> None:
    """Under torchrun: every rank's fresh adapters set to rank 0's (each rank draws A from its own RNG; seeded alike
    they agree, and this makes it so whatever a model's loading drew before)."""
    if not dist.distributed():
        return
    import torch.distributed

    device = dist.collective_device()
    for p in params:
        value = p.data.to(device)
        torch.distributed.broadcast(value, src=0)
        p.data.copy_(value)


def _tied_parameters(model: torch.nn.Module) -> set[int]:
    """The ids of parameters that `model` holds under more than one name."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def load_adapter(model: torch.nn.Module, path: str | Path, trainable: bool = True) -> torch.nn.Module:
    """The base `model` with the adapter saved in `path` (peft's format), in eval mode; `trainable`: the adapter's
    weights require gradients (to go on training it). ValueError naming `path` when the adapter does not fit the model
    (other module names or shapes: an adapter of another base)."""
    peft = _peft()
    try:
        adapted = peft.PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ValueError(f"{path}: the LoRA adapter does not fit the base model "
                         f"({str(e).splitlines()[0][:200]})") from None
    return adapted.eval()


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps: those that require gradients (with adapters: the adapters' alone)."""
    return [p for p in model.parameters() if p.requires_grad]


def as_reference(model: torch.nn.Module):
    """A context in which `model` is the KL reference: a peft actor with its adapters switched off (the base model),
    any other model (a separately loaded base) as it is."""
    return model.disable_adapter() if is_adapted(model) else nullcontext()


@contextmanager
def adapter_dropout(model: torch.nn.Module, seed: int | None = None) -> Iterator[None]:
    """The adapters' dropout (`model.lora.dropout` > 0) on inside the block and off again after. Its masks come from
    the global RNG seeded with `seed` (+ the rank: on several ranks each draws its own masks for its own rows) inside
    a fork, so the global streams are left as they were and a replay of the step draws the same masks. Nothing
    happens without adapter dropout."""
    drops = [m for name, m in model.named_modules() if name.endswith(".lora_dropout")  # one ModuleDict per layer
             and any(isinstance(d, torch.nn.Dropout) and d.p > 0 for d in m.modules())]
    if not drops:
        yield
        return
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed + dist.rank())
        for m in drops:
            m.train()
        try:
            yield
        finally:
            for m in drops:
                m.eval()


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own names) with every adapted weight replaced by W + scale x B A, computed into
    new CPU tensors; `model`'s own weights are not touched. Loads into the bare base architecture. `state`: the peft
    model's whole state dict (its own names) to merge, e.g. gathered from ranks (`sharding.full_state_dict`); None:
    the model's own."""
    peft = _peft()
    weights = {key.removeprefix(PEFT_PREFIX): tensor.detach().cpu()
               for key, tensor in (model.state_dict() if state is None else state).items()}
    deltas = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            adapter = module.active_adapters[0]
            delta = weights[f"{name}.lora_B.{adapter}.weight"] @ weights[f"{name}.lora_A.{adapter}.weight"]  # [out, in]
            deltas[f"{name}.weight"] = (delta.T if module.fan_in_fan_out else delta) * module.scaling[adapter]
    merged = {}
    for key, tensor in weights.items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        merged[key] = tensor + deltas[key] if key in deltas else tensor
    return merged


@torch.no_grad()
def merged_weights(model: torch.nn.Module, adapted_blocks: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The base model's parameters under its own names (a tied weight once), every adapted weight replaced by
    W + scale x B A computed into a new tensor on its device; `model`'s own weights are not touched. What an engine
    of the bare base architecture loads (`rollout.vllm_engine`).

    `adapted_blocks`: only the parameters of the blocks that hold an adapted module (the module's parent: its
    attention or MLP), the only ones the adapters change, whole, since an engine may fuse sibling projections
    (q/k/v, gate/up) into one layer that must be loaded complete."""
    peft = _peft()
    base = model.get_base_model()
    adapted = {name: module for name, module in base.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}
    blocks = tuple(f"{parent}." if parent else "" for parent in (name.rpartition(".")[0] for name in adapted))
    weights = []
    for key, p in base.named_parameters():
        if ".lora_" in key:
            continue
        module, _, leaf = key.replace(".base_layer.", ".").rpartition(".")
        if adapted_blocks and not f"{module}.".startswith(blocks):
            continue
        layer = adapted.get(module)
        if layer is not None and leaf == "weight":
            delta = layer.get_delta_weight(layer.active_adapters[0])  # a new tensor: W is added into it
            weights.append((f"{module}.weight", delta.add_(p.detach())))
        else:
            weights.append((f"{module}.{leaf}", p.detach()))
    return weights


def save_merged(model: torch.nn.Module, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write the merged model (`merged_state_dict` of `model`, or of its gathered `state`) to `directory` with
    `save_pretrained` (config.json, safetensors)."""
    model.get_base_model().save_pretrained(directory, state_dict=merged_state_dict(model, state),
                                           safe_serialization=True)


@dataclass(frozen=True)
class AdapterCount:
    """What a LoRA actor trains: its adapters' rank and alpha, the trained and total parameter counts (peft's
    `get_nb_trainable_parameters`, each tied weight once) and the adapted modules."""

    rank: int
    alpha: float
    trained: int
    total: int
    modules: int

    def words(self) -> str:
        """The run's LoRA line: rank, alpha, what trains, and what the reference and the analysis are."""
        return (f"LoRA rank {self.rank}, alpha {self.alpha:g} on {self.modules} modules: {self.trained:,} of "
                f"{self.total:,} parameters train ({100 * self.trained / max(self.total, 1):.2f} %); the KL reference "
                "is the base (adapters off); the gradient analysis runs over the adapter parameters")


def count(model: torch.nn.Module) -> AdapterCount:
    """The `AdapterCount` of a peft actor (its active adapter's settings)."""
    peft = _peft()
    config = model.peft_config[model.active_adapter]
    trained, total = model.get_nb_trainable_parameters()
    modules = sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())
    return AdapterCount(rank=config.r, alpha=config.lora_alpha, trained=trained, total=total, modules=modules)
