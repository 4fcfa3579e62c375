"""The `rldyn` command line: one sub-command per job, each a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from rldynamics import __version__
from rldynamics.config import EnvConfig, documented_keys, resume_may_change
from rldynamics.envs import ENVS

DEFAULT_PRESET = "sokoban-tiny"
VALUE_RULES = f"""\
values: text keys keep the text as typed (log.name=no is "no"); whole numbers are decimal (010 is 10);
numbers must be finite; switches take true/false, yes/no or on/off; null (or nothing) unsets a key whose
default is null; lists are YAML lists ([6, 6]). A resumed run keeps its config.yaml: only
{resume_may_change()} may change."""

TRAIN_EPILOG = """\
examples:
  rldyn train                                       # embedded default: tiny model, Sokoban, CPU, minutes
  rldyn train --preset sokoban-tiny-ppo             # the same with PPO (GAE + critic), CPU, about 40 minutes
  rldyn train --preset sokoban-ppo model.path=/models/Qwen2.5-3B filter.value=0.9
  rldyn train --preset frozenlake-tiny env.frozenlake.success_rate=0.5   # FrozenLake, half the moves slip
  rldyn train train.steps=5 val.env_groups=32 log.name=smoke
  rldyn train --preset countdown-tiny               # Countdown (arithmetic, one answer) on the tiny model
  rldyn train log.name=smoke checkpoint.resume=latest train.steps=10   # continue run "smoke" to step 10
  rldyn train --help-config                         # every config key with its default and meaning
  rldyn train --help-config --ragen                 # the RAGEN / verl keys accepted and what they become
  rldyn train actor_rollout_ref.rollout.rollout_filter_value=0.9 es_manager.train.env_groups=8  # RAGEN's names
  rldyn train analysis.every=5                      # gradient analysis every 5 steps (default: 50, RAGEN's)
  rldyn train health.entropy_collapse=stop health.grad_spike=rollback   # health rules' actions (docs/health.md)
  rldyn train health.policy_drift=rollback health.remedy=[train.lr*=0.5]  # roll back, then go on at half the lr
  rldyn train --nproc 1                             # one process (default on a CPU of 2+ cores: 2 ranks, --nproc auto)
  rldyn train model.threads=2                       # one process on 2 torch threads (default: OMP_NUM_THREADS, else
                                                    # half the cores, at most 4)
  rldyn train --preset math-tiny                    # math word problems (rldynamic's reward components), CPU
  rldyn train --preset math-smollm2                 # a real pretrained model (SmolLM2-135M-Instruct) on this CPU
  rldyn train model.path=/models/my.gguf model.dtype=bfloat16 model.gradient_checkpointing=true  # GGUF, mixed precision
  rldyn train --preset math-tiny model.lora.rank=8 checkpoint.save_merged=true   # LoRA adapters (docs/lora.md)
  rldyn train --preset gsm8k-grpo model.path=/models/Qwen2.5-3B-Instruct env.math.source=/data/gsm8k/train.jsonl
  rldyn train --preset math-tiny env.reward_funcs=[my_rewards:near_20_chars] env.reward_weights.near_20_chars=0.5  # TRL-style
  rldyn train env.name=prompts env.max_turns=1 env.prompts.source=/data/my_set env.reward_funcs=[my_rewards:says_answer,my_rewards:near_20_chars]
  rldyn train rollout.staleness=1 rollout.overlap=true train.row_seeded_sampling=true  # next rollout during the update
  rldyn train --nproc 8 --preset sokoban-ppo model.path=/models/Qwen2.5-3B   # 8 GPUs, FSDP2 (docs/multi-device.md)
  torchrun --nproc-per-node 8 -m rldynamics.cli train --preset sokoban-ppo   # the same, launched by hand
"""


SWEEP_EPILOG = """\
protocols (RAGEN's intervention scripts, as overrides on top of any preset):
  top_p     filter.value over 1.0,0.98,0.95,0.9,0.8,0.6,0.4,nofilter; top_p softmax largest on reward std,
            loss scaling none, KL 0.001 (k1), entropy 0.001; `1.0` drops zero-variance groups
            (include_zero false), `nofilter` is 1.0 keeping them (include_zero true)
  kl        algo.kl_coef over 0,0.001,0.003,0.01,0.03,0.1; entropy 0, filter off (value 1.0,
            include_zero true; --exclude-zero sets it false); no reference model at 0
  entropy   algo.entropy_coef over the same values; KL 0, filter off as in kl
  custom    any config KEYs, one --values list per key; several keys give the full grid

Each (point, seed) is a run directory OUT/<point>/seed<s>/ written by `rldyn train` (log in train.log).
Runs checkpoint at every validation unless checkpoint.* is given; re-running the same command skips
finished runs and resumes the others. An early-stopped run is a failed regime (RAGEN's protocol).
One sweep at a time per OUT; the runs stop with their sweep, even a killed one; seed, log.name,
log.run_dir and checkpoint.resume are set by the sweep (never swept).

examples:
  rldyn sweep top_p --values 0.9,nofilter --seeds 0,1,2 --parallel 2
  rldyn sweep kl --preset sokoban-ppo model.path=/models/Qwen2.5-3B --devices 0,1,2,3,4,5,6,7
  rldyn sweep entropy --values 0,0.01 --exclude-zero --devices 0,1,2,3 --devices-per-run 2
  rldyn sweep custom train.lr algo.clip_high --values 1e-4,3e-4 --values 0.2,0.28 --seeds 0,1
  rldyn sweep top_p --dry-run                       # print every point's overrides and exit
  rldyn sweep --summarize sweeps/top_p-sokoban-tiny  # rebuild the summary from the run directories
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rldyn",
        description="rldynamics: RL training of language-model agents with training-dynamics diagnostics.",
    )
    parser.add_argument("--version", action="version", version=f"rldynamics {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    _add_sft(sub)
    _add_probe(sub)
    _add_replay(sub)
    _add_eval(sub)
    _add_plot(sub)
    _add_report(sub)
    _add_doctor(sub)
    _add_sweep(sub)
    _add_envs(sub)
    return parser


def _add_train(sub) -> None:
    train = sub.add_parser(
        "train", help="train an agent (default: tiny model on Sokoban, CPU)",
        description="Train an LLM agent with PPO/GRPO. Settings are `key=value` overrides on a preset; "
                    "the run directory (config, metrics, samples, checkpoints) is written under log.run_dir. "
                    "A resumed run (checkpoint.resume=latest|PATH) keeps the settings of its config.yaml; only "
                    f"{resume_may_change()} may be changed, other changes are refused. Several ranks: --nproc W, "
                    "or torchrun (docs/multi-device.md).",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=1e-5")
    train.add_argument("--preset", default=None, help=f"preset name (default: {DEFAULT_PRESET})")
    train.add_argument("--config", default=None, help="YAML file merged after the preset, before overrides "
                                                      "(overrides may come before or after it)")
    train.add_argument("--nproc", type=_nproc_arg, default="auto", metavar="W",
                       help="ranks on this machine: runs `torchrun --standalone --nproc-per-node W` over this command "
                            "(one GPU per rank; gloo on CPU); see docs/multi-device.md. auto (the default): 2 on a "
                            "CPU with 2 or more usable cores and no thread count set (model.threads, OMP_NUM_THREADS), "
                            "when the run can take two ranks (with vLLM: an engine and a replica per rank, where the "
                            "available memory holds them); else 1")
    train.add_argument("--help-config", action="store_true", help="list every config key and exit")
    train.add_argument("--ragen", action="store_true",
                       help="with --help-config: list the RAGEN / verl override names accepted and what they become")


SFT_EPILOG = """\
examples:
  rldyn sft --preset frozenlake-smollm2 log.name=fl-warm     # SmolLM2 imitates the solver (30 % random moves)
  rldyn train --preset frozenlake-smollm2 model.path=runs/fl-warm/checkpoints/step_31/actor   # then RL from it
  rldyn sft --preset bandit-smollm2 log.name=bandit-warm   # the format and arm names only (every arm random)
  rldyn sft --preset frozenlake-tiny sft.lr=1e-3 sft.episodes=2000 sft.noise=0.3   # the untrained tiny model
  rldyn sft --preset math-smollm2 sft.data=/data/chats.jsonl sft.success=false      # TRL's `messages` rows
  rldyn sft --preset frozenlake-smollm2 model.lora.rank=16 checkpoint.save_merged=true   # LoRA; RL from actor_merged/
  rldyn sft log.name=fl-warm checkpoint.resume=latest        # continue a killed fine-tuning
"""


def _add_sft(sub) -> None:
    sft = sub.add_parser(
        "sft", help="supervised fine-tuning on demonstrations (a warm start before RL)",
        description="Fine-tune a model on conversations: the env's own solver playing training puzzles in the exact "
                    "chat the env plays (never a validation puzzle), or a data set in TRL's conversational format "
                    "(sft.data). The loss is on the assistant's tokens only; conversations are packed. The held-out "
                    "validation success is measured before and after (the trainer's validation stage), and "
                    "checkpoints are the trainer's: train on one with rldyn train model.path=<checkpoint>/actor. "
                    "Keys: sft.* (rldyn train --help-config), with model.*, env.*, val.*, checkpoint.* and log.*.",
        epilog=SFT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sft.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. sft.episodes=2000")
    sft.add_argument("--preset", default=None, help=f"preset of the env, model and validation (default: "
                                                    f"{DEFAULT_PRESET})")
    sft.add_argument("--config", default=None, help="YAML file merged after the preset, before overrides")


def _add_probe(sub) -> None:
    probe = sub.add_parser(
        "probe", help="gradient analysis of a saved checkpoint (no training)",
        description="Load a checkpoint, roll out a batch from a fixed seed stream (the env and sampling seeds of "
                    "a run's step 1, whatever the checkpoint, so probes of different checkpoints see the same "
                    "puzzles) and run one gradient-analysis pass (reward-variance buckets x task/entropy/KL "
                    "gradient norms), logged at the checkpoint's step; writes its own run directory, never a "
                    "checkpoint, and never stops early. Defaults: KL k3 0.001 and entropy 0.001 enabled so both "
                    "are measured. The KL reference is the base model of the checkpoint's run, built from its "
                    "config.yaml (runs/<run>/config.yaml), so model.path, tiny.* and model.warm_start_* "
                    "cannot be overridden. RAGEN / verl override names are accepted (rldyn train --help-config "
                    "--ragen).",
    )
    probe.add_argument("checkpoint", help="runs/<run>/checkpoints/step_<N>")
    probe.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. analysis.env_groups=32 analysis.prefilter=true")
    probe.add_argument("--validate", action="store_true", help="run a validation before the analysis")


REPLAY_EPILOG = """\
examples:
  rldyn replay runs/smoke --step 10                  # recompute step 10 from the checkpoint before it; same weights?
  rldyn replay runs/smoke --step 10 --attribute      # ... and attribute its gradient to replies and tokens
  rldyn replay runs/smoke --step 10 train.lr=1e-5    # what-if: the same step with a lower learning rate
  rldyn replay runs/smoke --step 10 algo.clip_high=0.1 filter.strategy=top_p filter.value=0.9
"""


def _add_replay(sub) -> None:
    replay = sub.add_parser(
        "replay", help="recompute a recorded step from the checkpoint before it; what-ifs; gradient attribution",
        description="Load the state before step N (checkpoints/step_<N-1>, the state kept beside "
                    "the record, or the run rolled forward to N-1) and the step's record "
                    "(records/step_<N>.safetensors: written for record.every, record.steps and "
                    "health alarms), recompute the step's update on the recorded rollout and "
                    "check it against the run: loss, gradient norm and the weights after it "
                    "(bit-identical on the same machine and thread count). A record of another "
                    "run is refused. key=value overrides replay the step changed (a what-if) and "
                    "compare the two updates: the losses and their coefficients (algo.*), "
                    "learning rates, clipping and mini-batches (train.lr, train.weight_decay, "
                    "train.max_grad_norm, train.mini_batch_size, train.ppo_epochs, critic.*) and "
                    "the filter (filter.*); the rollout (env.*, rollout.*, seed, "
                    "train.group_size, train.env_groups, ...) and the model (model.*) are what "
                    "the run recorded and saved, and overrides of them are refused. --attribute "
                    "writes each trajectory's, group's and token's share of the step's gradient "
                    "(attribution.json), says how its norm relates to the recorded "
                    "actor/grad_norm and writes the run's report.html again (its sample browser "
                    "shows them). Output: RUN/replays/step_<N>[_<what-if>]/, renamed into place "
                    "once complete: a Ctrl-C leaves the earlier replay as it was "
                    "(docs/forensics.md).",
        epilog=REPLAY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument("run_dir", help="runs/<run>")
    replay.add_argument("--step", type=int, required=True, help="the recorded step (ls RUN/records)")
    replay.add_argument("--attribute", action="store_true",
                        help="attribute the step's gradient to its trajectories, groups and tokens "
                             "(and write the run's report.html again)")
    replay.add_argument("overrides", nargs="*", metavar="key=value",
                        help="what-if overrides for step N, e.g. train.lr=1e-6 algo.clip_high=0.1 "
                             "(losses, learning rates, clipping, mini-batches, filter; not the "
                             "rollout or the model)")


def _add_eval(sub) -> None:
    evaluate = sub.add_parser(
        "eval", help="validate a checkpoint or a model (success, pass@k, reward components, response length)",
        description="One validation (the trainer's: the fixed validation seeds, val.group_size samples each at "
                    "val.temperature) of a checkpoint, under its run's config.yaml and logged at its step, or of a "
                    "model (directory, cached hub id, .gguf, tiny) under a preset; printed as a table and written to "
                    "a run directory of its own (config.yaml, metrics.jsonl). Nothing is trained. A checkpoint's "
                    "files are verified against its manifest first, as rldyn probe and a resume do.",
        epilog="examples:\n  rldyn eval runs/my_run/checkpoints/step_100\n"
               "  rldyn eval runs/my_run/checkpoints/step_100 val.env_groups=1024 val.group_size=4   # pass@4\n"
               "  rldyn eval /models/Qwen2.5-0.5B-Instruct --preset gsm8k-grpo env.math.source=/data/gsm8k_test.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("target", metavar="CHECKPOINT_OR_MODEL",
                          help="runs/<run>/checkpoints/step_<N>, a model directory, a cached hub id, a .gguf or tiny")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. val.env_groups=64")
    evaluate.add_argument("--preset", default=None,
                          help=f"preset (default: the checkpoint's run config, or {DEFAULT_PRESET} for a model)")


def _add_plot(sub) -> None:
    plot = sub.add_parser(
        "plot", help="figures of a run directory (gradient analysis per step, training curves)",
        description="Write RAGEN's gradient-analysis figures for every analysis step, the training curves and "
                    "the analysis views (cosines, regulariser share, sketch cosines; with analysis.per_group the "
                    "per-group norm-vs-RV figure and 95 % interval whiskers) from a run directory. "
                    "Reads only the run directory: works offline, on runs copied from other machines.",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (several with --paper)")
    plot.add_argument("--step", type=int, nargs="+", dest="steps", help="analysis steps to plot (default: all)")
    plot.add_argument("--list-steps", action="store_true", help="print the analysis steps and exit")
    plot.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    plot.add_argument("--paper", action="store_true",
                      help="multi-step grid (one row per step) overlaying 1+ runs (one colour per run)")
    plot.add_argument("--steps", type=int, nargs="+", dest="paper_steps", help="steps of the --paper grid")


def _add_report(sub) -> None:
    report = sub.add_parser("report", help="one self-contained HTML page: config, curves, analysis, health",
                            description="Write RUN_DIR/report.html with figures embedded and health checks.")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html)")


DOCTOR_EPILOG = """\
examples:
  rldyn doctor runs/cd                        # an rldynamics run: the alarms its own monitor wrote
  rldyn doctor out/checkpoint-500/trainer_state.json    # a TRL run's logged metrics
  rldyn doctor out/runs/Nov28_10-00-00_host   # TensorBoard event files (transformers' or ours)
  rldyn doctor history.csv --out diag         # a W&B history export (CSV or JSONL, a _step column)
  rldyn doctor trainer_state.json health.entropy_collapse_ratio=0.2 health.zero_variance_steps=3

Writes events.jsonl and health_report.html into --out (default PATH/doctor/, or doctor/ beside a
file) and prints the verdict and one line naming the rules the logs cannot feed
(docs/integrations.md).
"""


def _add_doctor(sub) -> None:
    doctor = sub.add_parser(
        "doctor", help="the health rules and report over a finished run's logs (ours, TRL, W&B)",
        description="Run the health monitor's rules over the logs of a finished run: an "
                    "rldynamics run directory, TRL's trainer_state.json, a W&B / TensorBoard "
                    "export (CSV, JSONL, event files). Each source's metric names map to the "
                    "monitor's signals by one table; rules whose signals the logs lack cannot "
                    "fire, and are named.",
        epilog=DOCTOR_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("path", metavar="PATH",
                        help="run directory, trainer_state.json, CSV / JSONL / TensorBoard export")
    doctor.add_argument("overrides", nargs="*", metavar="health.key=value",
                        help="health settings (default: the run's own, else the defaults)")
    doctor.add_argument("--out", default=None, help="output directory (default: PATH/doctor/)")


def _add_sweep(sub) -> None:
    sweep = sub.add_parser(
        "sweep", help="intervention sweep (top_p / kl / entropy / custom) over points x seeds, in parallel",
        description="Run every point x seed of a sweep as separate `rldyn train` processes (CPU thread shares or "
                    "disjoint GPU sets), with a live table, then write summary.{csv,md,html} and figures to OUT.",
        epilog=SWEEP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument("name", nargs="?", metavar="NAME", help="top_p | kl | entropy | custom")
    sweep.add_argument("items", nargs="*", metavar="[KEY ...] key=value",
                       help="custom: the config keys to sweep; then overrides applied to every run")
    sweep.add_argument("--values", action="append", metavar="V1,V2,...",
                       help="the values of the swept key (custom: one --values per KEY, in order)")
    sweep.add_argument("--seeds", default="0", help="comma-separated seeds, one run per point and seed (default: 0)")
    sweep.add_argument("--parallel", type=int, default=None,
                       help="CPU: runs at a time, the cores split between them (default: 1)")
    sweep.add_argument("--devices", default=None, metavar="0,1,...",
                       help="GPU ids; each run gets its own --devices-per-run of them (CUDA_VISIBLE_DEVICES)")
    sweep.add_argument("--devices-per-run", type=int, default=1, metavar="D",
                       help="GPUs per run (default: 1); a run on several trains on all of them (rldyn train --nproc D)")
    sweep.add_argument("--preset", default="sokoban-tiny", help="preset of every run (default: sokoban-tiny)")
    sweep.add_argument("--config", default=None, help="YAML file merged after the preset, before overrides")
    sweep.add_argument("--out", default=None, help="sweep directory (default: sweeps/<NAME>-<preset>)")
    sweep.add_argument("--exclude-zero", action="store_true",
                       help="kl / entropy: filter.include_zero=false (drop zero-variance groups; RAGEN's filter_zero)")
    sweep.add_argument("--dry-run", action="store_true", help="print the points' overrides and the runs, then exit")
    sweep.add_argument("--summarize", metavar="OUT", default=None,
                       help="only rebuild OUT's summary files from its run directories")


def _add_envs(sub) -> None:
    sub.add_parser("envs", help="list the environments with their keys, defaults and reward components",
                   description="Every registered env: its keys (env.<name>.<key>=default  meaning), its reward "
                               "components with their default weights, and its action words.")


def _run_job(command: str, job, check=None) -> int:
    """Run `check()` (the settings, read without torch: a bad key or value answers at once), then `job(checked)`
    (which returns a run directory); report bad input as one clear line and exit code 2.

    Under torchrun the process joins the process group after the check; rank 0 alone prints."""
    say = print if _main_rank() else (lambda *a, **k: None)
    code, checked = _one_line_errors(command, say, check or (lambda: None))
    if code:
        return code
    from transformers.utils import logging as hf_logging

    from rldynamics import dist

    hf_logging.disable_progress_bar()  # per-file load/save bars would drown the training progress bar
    dist.init_from_env()
    code, run_dir = 1, None
    try:
        code, run_dir = _one_line_errors(command, say, lambda: job(checked))
    finally:
        dist.close(finished=code == 0)
    if run_dir is not None:
        say(f"run directory: {run_dir}")
    return code


def _one_line_errors(command: str, say, fn) -> tuple[int, object]:
    """(0, fn()), or (2, None) after saying in one line why bad input stopped it."""
    from rldynamics.config import ConfigError

    try:
        return 0, fn()
    except ConfigError as e:
        say(f"rldyn {command}: config error: {_one_line(e)}", file=sys.stderr)
    except (FileExistsError, FileNotFoundError, ValueError, OSError, ImportError) as e:
        say(f"rldyn {command}: {_one_line(e)}", file=sys.stderr)
    return 2, None


def _a_rank() -> bool:
    """This process is a rank of a torchrun job (its environment names the world), not a launcher."""
    import os

    return "WORLD_SIZE" in os.environ


def _main_rank() -> bool:
    """This process prints: one process, or rank 0 under torchrun (read from its RANK variable, before torch)."""
    import os

    return os.environ.get("RANK", "0") == "0"


def _nproc_arg(value: str) -> int | str:
    """`--nproc`: `auto` or a rank count >= 1."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a number of ranks >= 1, got {value!r}")
    return int(value)


def _auto_nproc(cfg) -> tuple[int, int | None]:
    """`--nproc auto`: (ranks, each rank's torch threads or None) for this run (`threads.auto_ranks`); says why when it
    starts several. One process under torchrun (this is a rank), on a GPU, with the vLLM engine where the machine's
    available memory does not hold an engine and a replica per rank (it says so, and what `--nproc` would give), or
    where the run cannot take two ranks (`setup.check_world`)."""
    from rldynamics.config import ConfigError
    from rldynamics.memory import available_memory
    from rldynamics.rollout.sizing import RANK_MEMORY_HEADROOM, engine_rank_memory
    from rldynamics.train.diagnostics import needs_reference
    from rldynamics.train.diagnostics.base import TRAIN
    from rldynamics.threads import auto_ranks, explicit_threads, rank_threads, usable_cores

    cores = usable_cores()
    ranks = auto_ranks(cores, threads_chosen=cfg.model.threads > 0 or explicit_threads() is not None)
    if ranks == 1 or _a_rank() or not _on_cpu(cfg.model.device):
        return 1, None
    engines = ""
    if cfg.rollout.engine != "hf":  # an engine per rank: as many ranks as the memory holds
        need, available = engine_rank_memory(cfg, reference=needs_reference(cfg, TRAIN)), available_memory()
        if need is None or available is None or ranks * need * RANK_MEMORY_HEADROOM > available:
            known = "" if need is None or available is None else \
                (f": {ranks} would need about {ranks * need / 2**30:.1f} GiB and a quarter to spare, "
                 f"{available / 2**30:.1f} available")
            print(f"one process with the {cfg.rollout.engine} engine (--nproc auto{known}); --nproc {ranks} "
                  f"model.shard=false trains on {ranks} ranks, an engine and a replica each: faster, about {ranks} "
                  "times the memory")
            return 1, None
        engines = f", an engine each (about {need / 2**30:.1f} GiB a rank, {available / 2**30:.1f} available)"
    from rldynamics.train.checkpoint import latest_checkpoint, saved_ranks
    from rldynamics.train.setup import check_world, resolve_run_dir

    resume = cfg.checkpoint.resume  # a resumed run keeps its ranks, and so goes on as it would have
    path = None if not resume else latest_checkpoint(resolve_run_dir(cfg)) if resume == "latest" else Path(resume)
    if path is not None and path.is_dir() and saved_ranks(path) != ranks:
        return 1, None
    try:
        check_world(cfg, ranks)
    except ConfigError:
        return 1, None
    threads = rank_threads(cores, ranks)
    print(f"{ranks} ranks of {threads} torch thread{'s' if threads > 1 else ''} on the {cores} usable cores{engines} "
          "(--nproc auto; --nproc 1 runs one process)")
    return ranks, threads


def _sets_shard(overrides: list[str], file: str | None) -> bool:
    """Whether the command line or its config file sets `model.shard` (else `--nproc auto` runs replicas: on the
    default tiny model a step took 2.15 s on two replicas against 2.7 s on two FSDP2 ranks)."""
    if any(o.lstrip("+").split("=")[0] == "model.shard" for o in overrides):
        return True
    import yaml

    return file is not None and "shard" in (yaml.safe_load(Path(file).read_text()) or {}).get("model", {})


def _recorded_ranks(run_dir: str, step: int) -> tuple[int, int | None]:
    """(ranks, threads) that trained `run_dir`'s recorded `step`; (1, None) under torchrun (this is a rank), or where
    the record cannot be read (the replay itself then says why)."""
    if _a_rank():
        return 1, None
    from rldynamics.tracking.step_records import RecordedStep, record_path

    try:
        record = RecordedStep.read(record_path(Path(run_dir).resolve(), step))
    except Exception:  # noqa: BLE001 (reported by the replay with its context)
        return 1, None
    return record.ranks, record.threads


def _on_cpu(device: str) -> bool:
    """Whether `model.device=device` computes on the CPU here (`auto` without a GPU)."""
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _launch(nproc: int, argv: list[str], threads: int | None = None, command: str = "train") -> int:
    """`rldyn train --nproc W ...` (or a replay of a step W ranks trained): the same command in W ranks under
    torchrun (each on `threads` torch threads when given), in a child process that (with every rank) stops when this
    process dies, however it dies (a killed sweep included); returns its exit code."""
    import os
    import subprocess

    from rldynamics.sweep.launch import THREAD_VARS, stop_with_parent

    env = {**os.environ, **(dict.fromkeys(THREAD_VARS, str(threads)) if threads else {})}
    child = ("import sys; from rldynamics.cli import run_torchrun; "
             "sys.exit(run_torchrun(int(sys.argv[1]), sys.argv[3:], sys.argv[2]))")
    return subprocess.call([sys.executable, "-c", child, str(nproc), command, *argv], env=env,
                           preexec_fn=stop_with_parent(os.getpid()))


def run_torchrun(nproc: int, argv: list[str], command: str = "train") -> int:
    """`torchrun --standalone --nproc-per-node W -m rldynamics.cli COMMAND ARGV`, run in this process; returns the exit
    code (2 for a one-line error, as in one process).

    A rank that fails has printed why (an error every rank raised is printed once, by rank 0), so torchrun's own
    report of the failure (log lines, a traceback and a table of ranks) is not shown: an error line is the last
    line, or, when a rank crashed or was killed, one line saying which. SIGTERM stops every rank."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "rldynamics.cli", command, *argv]))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode == 2:  # a one-line error, printed by the rank
            return 2
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"failed with exit code {failure.exitcode} (its output is above)")
        print(f"rldyn {command}: rank {rank} {how}; the other ranks were stopped", file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"rldyn {command}: stopped by {e.sigval.name}; every rank was stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def _one_line(error: Exception) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def cmd_train(args: argparse.Namespace) -> int:
    from rldynamics.config import help_text, make_config, preset_names

    if args.help_config and args.ragen:
        from rldynamics.ragen_keys import help_table

        print("RAGEN / verl override names accepted (pasted as they are; +key= and ++key= work too) and what they "
              f"become:\n{help_table()}\nOther keys under RAGEN's sections are refused by name.")
        return 0
    if args.help_config:
        print(f"presets: {', '.join(preset_names())}\n\n{VALUE_RULES}\n\nconfig keys (key=default  meaning):\n"
              f"{help_text()}\n\nRAGEN / verl override names are accepted too: rldyn train --help-config --ragen")
        return 0

    def config(launcher: bool = False):
        if not launcher:
            _print_ragen_translation(args.overrides)
        cfg = make_config(args.preset or DEFAULT_PRESET, args.config, args.overrides)  # fails before any work
        if cfg.checkpoint.resume:  # a resumed run starts from its saved settings, changed only where asked
            from rldynamics.train.setup import resume_base

            cfg = make_config(args.preset, args.config, args.overrides, base=resume_base(cfg))
        if not launcher:
            _print_start_warnings(cfg, args.preset or DEFAULT_PRESET, args.config, args.overrides)
        return cfg

    nproc, threads, rank_argv = args.nproc, None, _without_nproc(args.argv)
    if nproc == "auto":
        from rldynamics.config import ConfigError

        try:
            nproc, threads = _auto_nproc(config(launcher=True))
        except (ConfigError, OSError, ValueError, ImportError):  # bad input: one process reports it, as always
            nproc = 1
        if nproc > 1 and not _sets_shard(args.overrides, args.config):  # replicas: one machine's CPU ranks
            rank_argv = ["model.shard=false", *rank_argv]
    if nproc != 1:  # the launcher checks what it can, once, then starts the ranks
        from rldynamics.train.setup import check_world

        return _run_job("train", lambda _: None, check=lambda: check_world(config(launcher=True), nproc)) or (
            _launch(nproc, rank_argv, threads))

    def job(cfg):
        from rldynamics.train.trainer import train

        return train(cfg)

    return _run_job("train", job, check=config)


def _print_ragen_translation(overrides: list[str]) -> None:
    """Say once what the RAGEN / verl keys among `overrides` became (nothing when there are none)."""
    from rldynamics.config import ragen_translation

    lines = ragen_translation(overrides)
    if lines and _main_rank():
        print("RAGEN / verl keys translated:\n" + "\n".join(f"  {line}" for line in lines))


def _print_start_warnings(cfg, preset: str | None, file: str | None, overrides: list[str]) -> None:
    """One line per setting that will not do what it seems to (`rldynamics.start_notes`), before any work."""
    from rldynamics import dist
    from rldynamics.start_notes import start_warnings

    if dist.is_main():
        for line in start_warnings(cfg, preset, file, overrides):
            print(line, file=sys.stderr)


def cmd_sft(args: argparse.Namespace) -> int:
    from rldynamics.config import make_config

    def config():
        cfg = make_config(args.preset or DEFAULT_PRESET, args.config, args.overrides)
        if cfg.checkpoint.resume:  # a resumed fine-tuning keeps its saved settings, changed only where allowed
            from rldynamics.train.setup import resume_base
            from rldynamics.train.sft import sft_run_dir

            cfg = make_config(args.preset, args.config, args.overrides, base=resume_base(cfg, sft_run_dir(cfg)))
        return cfg

    def job(cfg):
        from rldynamics.train.sft import run_sft

        return run_sft(cfg)

    return _run_job("sft", job, check=config)


def cmd_probe(args: argparse.Namespace) -> int:
    def job(_):
        from rldynamics.train.probe import probe_checkpoint

        _print_ragen_translation(args.overrides)
        return probe_checkpoint(args.checkpoint, args.overrides, validate=args.validate)

    return _run_job("probe", job)


def cmd_replay(args: argparse.Namespace) -> int:
    ranks, threads = (1, None) if args.attribute else _recorded_ranks(args.run_dir, args.step)
    if ranks > 1:  # the step's ranks again, so the update sums as the run did (`train.replay`)
        return _launch(ranks, args.argv, threads, command="replay")

    def job(_):
        from rldynamics.train.replay import replay_command

        return replay_command(args.run_dir, args.step, args.overrides, attribute=args.attribute)

    return _run_job("replay", job)


def cmd_eval(args: argparse.Namespace) -> int:
    def check():
        from rldynamics.train.evaluate import eval_config

        _print_ragen_translation(args.overrides)
        return eval_config(args.target, args.preset, args.overrides, DEFAULT_PRESET)

    def job(checked):
        from rldynamics.train.evaluate import eval_run_dir, evaluate, is_checkpoint, metrics_table

        cfg, step = checked
        run_dir = eval_run_dir(cfg, args.target, step)
        metrics = evaluate(cfg, run_dir, step, Path(args.target) if is_checkpoint(args.target) else None)
        print(f"eval of {args.target} (step {step}, {cfg.val.env_groups} x {cfg.val.group_size} {cfg.env.name} "
              f"validation rollouts at temperature {cfg.val.temperature:g}):\n{metrics_table(metrics, cfg.env.name)}")
        return run_dir

    return _run_job("eval", job, check=check)


def cmd_plot(args: argparse.Namespace) -> int:
    from rldynamics.plots.cli import plot_command

    if not args.paper and len(args.run_dirs) > 1:
        print("rldyn plot: several run directories need --paper", file=sys.stderr)
        return 2
    run_dir = args.run_dirs if args.paper else args.run_dirs[0]
    return plot_command(run_dir, args.steps, args.list_steps, args.out, args.paper, args.paper_steps)


def cmd_report(args: argparse.Namespace) -> int:
    from rldynamics.plots.cli import report_command

    return report_command(args.run_dir, args.out)


def cmd_doctor(args: argparse.Namespace) -> int:
    from rldynamics.integrations.doctor import doctor

    code, lines = _one_line_errors("doctor", print,
                                   lambda: doctor(args.path, args.out, args.overrides))
    if not code:
        print("\n".join(lines))
    return code


def cmd_sweep(args: argparse.Namespace) -> int:
    from rldynamics.sweep.command import summarize_command, sweep_command

    if args.summarize:
        if args.name or args.items:
            print("rldyn sweep: --summarize OUT takes no NAME or overrides", file=sys.stderr)
            return 2
        return summarize_command(args.summarize)
    if not args.name:
        print("rldyn sweep: give a sweep NAME (top_p, kl, entropy, custom) or --summarize OUT", file=sys.stderr)
        return 2
    return sweep_command(args.name, args.items, args.values, args.seeds, args.parallel, args.devices,
                         args.devices_per_run, args.preset, args.config, args.out, args.exclude_zero, args.dry_run)


def cmd_envs(args: argparse.Namespace) -> int:
    print(envs_help())
    return 0


def envs_help() -> str:
    """`rldyn envs`: each env's keys with defaults and meanings, reward components and actions."""
    blocks = []
    shared = EnvConfig()
    for name, cls in ENVS.items():
        try:
            env = cls(**dataclasses.asdict(cls.Config()))
        except ValueError:  # an env that needs a setting to be built (prompts: its data set): its class says enough
            env = cls
        weights = ", ".join(f"{r} (weight {env.reward_weights.get(r, 1.0):g})" for r in env.reward_names) or (
            "none of its own: env.reward_funcs")
        actions = ", ".join(env.actions) if env.actions else "free-form answer text"
        actions = "the whole reply" if getattr(env, "full_reply", False) else actions
        if env is cls:  # not built with its defaults: an env whose actions are settings says which
            actions = getattr(cls, "actions_help", actions)
        penalty = ("; graded on the whole reply (no format_penalty)" if getattr(env, "full_reply", False) else
                   f"; plus format_penalty (env.format_penalty={shared.format_penalty:g}) for malformed turns")
        lines = [f"{name}  ({cls.__module__}.{cls.__name__})", f"  reward components: {weights}{penalty}",
                 f"  actions: {actions}"]
        keys = documented_keys(cls.Config(), f"env.{name}.")
        width = max((len(f"{key}={default!s}") for key, default, _ in keys), default=0)
        lines += [f"  {f'{key}={default!s}':<{width}}  {doc}" for key, default, doc in keys]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\nshared keys: env.name, env.max_turns, env.max_actions_per_turn, " \
        "env.max_actions_per_traj, env.max_new_tokens, env.enable_think, env.open_answer, env.format_penalty, " \
        "env.reward_weights, env.reward_funcs (`rldyn train --help-config`)."


def _without_nproc(argv: list[str]) -> list[str]:
    """The `rldyn train` arguments less `--nproc W` / `--nproc=W` (each rank runs the rest)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc":
            skip = True
        elif not item.startswith("--nproc="):
            out.append(item)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; exits with a usage error (argparse's) on an unknown option or sub-command."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = argv[argv.index(args.command) + 1:] if args.command in ("train", "replay") else []
    # argparse takes one run of positionals: items after an option (`--config F a=1`, `sweep NAME --values V a=1`)
    # come back here; train and probe take them as key=value overrides, sweep as its items
    if extra:
        field = "items" if args.command == "sweep" else "overrides"
        if not hasattr(args, field) or any(x.startswith("-") or (field == "overrides" and "=" not in x) for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(args, field, [*getattr(args, field), *extra])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        build_parser().print_help()
        return 0
    commands = {"train": cmd_train, "sft": cmd_sft, "probe": cmd_probe, "replay": cmd_replay, "eval": cmd_eval,
                "sweep": cmd_sweep, "plot": cmd_plot,
                "report": cmd_report, "doctor": cmd_doctor, "envs": cmd_envs}
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        if _main_rank():
            print(f"rldyn {args.command}: stopped by Ctrl-C; {INTERRUPTED.get(args.command, 'nothing was written')}",
                  file=sys.stderr)
        return 130


INTERRUPTED = {  # what a Ctrl-C leaves, per command (any other: nothing)
    "train": "the run directory holds every finished step and checkpoint (continue: the same command with "
             "checkpoint.resume=latest log.name=<run>)",
    "sft": "the run directory holds every finished step and checkpoint (continue: the same command with "
           "checkpoint.resume=latest log.name=<run>)",
    "probe": "its run directory holds what was logged before the stop",
    "eval": "nothing was written (the run directory is written only at the end)",
    "plot": "figures already written are complete; run it again for the rest",
    "report": "no report was written (the page is written at the end)",
    "replay": "replays/ holds complete replays only: a replay directory is replaced once its "
              "replay is complete, so the one interrupted was discarded and its earlier "
              "results are kept (a roll-forward cut short is done again by the next replay)",
}


if __name__ == "__main__":
    sys.exit(main())
