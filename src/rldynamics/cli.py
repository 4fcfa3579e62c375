"""The `rldyn` command line: one sub-command per job, each a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import sys

from rldynamics import __version__

TRAIN_EPILOG = """\
examples:
  rldyn train                                       # embedded default: tiny model, Sokoban, CPU, minutes
  rldyn train --preset sokoban-ppo model.path=/models/Qwen2.5-3B filter.value=0.9
  rldyn train --preset frozenlake-tiny env.frozenlake.success_rate=0.5   # FrozenLake, half the moves slip
  rldyn train train.steps=5 val.env_groups=32 log.name=smoke
  rldyn train log.name=smoke checkpoint.resume=latest train.steps=10
  rldyn train --help-config                         # every config key with its default and meaning
  rldyn train analysis.enabled=true analysis.every=5  # gradient analysis every 5 steps
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rldyn",
        description="rldynamics: RL training of language-model agents with training-dynamics diagnostics.",
    )
    parser.add_argument("--version", action="version", version=f"rldynamics {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train", help="train an agent (default: tiny model on Sokoban, CPU)",
        description="Train an LLM agent with PPO/GRPO. Settings are `key=value` overrides on a preset; "
                    "the run directory (config, metrics, samples, checkpoints) is written under log.run_dir.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=1e-5")
    train.add_argument("--preset", default="sokoban-tiny", help="preset name (default: sokoban-tiny)")
    train.add_argument("--config", default=None, help="YAML file merged after the preset, before overrides")
    train.add_argument("--help-config", action="store_true", help="list every config key and exit")

    probe = sub.add_parser(
        "probe", help="gradient analysis of a saved checkpoint (no training)",
        description="Load a checkpoint, roll out the next step's batch and run one gradient-analysis pass "
                    "(reward-variance buckets x task/entropy/KL gradient norms); writes a run directory. "
                    "Defaults: KL k3 0.001 and entropy 0.001 enabled so both are measured.",
    )
    probe.add_argument("checkpoint", help="runs/<run>/checkpoints/step_<N>")
    probe.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. analysis.env_groups=32 analysis.prefilter=true")
    probe.add_argument("--validate", action="store_true", help="run a validation before the analysis")

    plot = sub.add_parser(
        "plot", help="figures of a run directory (gradient analysis per step, training curves)",
        description="Write RAGEN's gradient-analysis figures for every analysis step, the training curves and "
                    "the analysis views (cosines, regulariser share, sketch cosines) from a run directory. "
                    "Reads only the run directory: works offline, on runs copied from other machines.",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (several with --paper)")
    plot.add_argument("--step", type=int, nargs="+", dest="steps", help="analysis steps to plot (default: all)")
    plot.add_argument("--list-steps", action="store_true", help="print the analysis steps and exit")
    plot.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    plot.add_argument("--paper", action="store_true", help="multi-step grid (one row per step) from 1+ runs")
    plot.add_argument("--steps", type=int, nargs="+", dest="paper_steps", help="steps of the --paper grid")

    report = sub.add_parser("report", help="one self-contained HTML page: config, curves, analysis, health",
                            description="Write RUN_DIR/report.html with figures embedded and health checks.")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html)")

    sub.add_parser("envs", help="list the environments with their keys, defaults and reward components",
                   description="Every registered env: its keys (env.<name>.<key>=default  meaning), its reward "
                               "components with their default weights, and its action words.")
    return parser


def _run_job(command: str, job) -> int:
    """Run `job()` (which returns a run directory); report bad input as one clear line and exit code 2."""
    from transformers.utils import logging as hf_logging

    from rldynamics.config import ConfigError

    hf_logging.disable_progress_bar()  # per-file load/save bars would drown the training progress bar
    try:
        run_dir = job()
    except ConfigError as e:
        print(f"rldyn {command}: config error: {e}", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError, ValueError, OSError, ImportError) as e:
        print(f"rldyn {command}: {e}", file=sys.stderr)
        return 2
    print(f"run directory: {run_dir}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from rldynamics.config import help_text, make_config, preset_names

    if args.help_config:
        print(f"presets: {', '.join(preset_names())}\n\nconfig keys (key=default  meaning):\n{help_text()}")
        return 0

    def job():
        cfg = make_config(args.preset, args.config, args.overrides)  # fails before any work on bad config
        from rldynamics.train.trainer import train

        return train(cfg)

    return _run_job("train", job)


def cmd_probe(args: argparse.Namespace) -> int:
    from rldynamics.train.probe import probe_checkpoint

    return _run_job("probe", lambda: probe_checkpoint(args.checkpoint, args.overrides, validate=args.validate))


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


def cmd_envs(args: argparse.Namespace) -> int:
    from rldynamics.config import envs_help

    print(envs_help())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    commands = {"train": cmd_train, "probe": cmd_probe, "plot": cmd_plot, "report": cmd_report, "envs": cmd_envs}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
