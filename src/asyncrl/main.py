"""The `rl` command: one subcommand per program, all reading the same config.

    rl run @ configs/demo.toml                  # all three, locally
    rl inference @ configs/demo.toml            # or each in its own terminal / host
    rl orchestrator @ configs/demo.toml
    rl trainer @ configs/demo.toml              # torchrun --nproc-per-node 2 -m trainer @ ...
    rl trainer @ configs/demo.toml --trainer.optim.lr 1e-4 --dry-run
    rl slurm @ configs/demo.toml > job.sbatch   # the same run as a SLURM job (docs/slurm.md)
    rl sft @ configs/sft_demo.toml              # supervised fine-tuning (docs/sft.md)
    rl plot runs/demo                           # the run's PNGs from its metrics.jsonl

Programs are imported only after the config parsed, so `--help` and config errors are instant.
`rl <program> --help` lists, after the usage, every config key the program reads with its
type, default and documentation (the key's docstring in rl/config/).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import click
import typer
from typer.core import TyperCommand

from rl import startup
from rl.config import ConfigError, RunConfig
from rl.rundir import RunDir

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="asyncrl: asynchronous RL post-training. Each command takes '@ cfg.toml' "
    "(several compose left to right), '--table.key value' overrides and '--dry-run'.",
)
_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}

# The config tables each command's --help lists besides the top-level keys: those its program
# reads ("trainer.lora": that sub-table only).
_ALL = ("checkpoints", "timeouts", "inference", "transport", "weight_sync", "orchestrator", "trainer", "tracking")
SECTIONS = {
    "inference": ("timeouts", "inference", "weight_sync", "trainer.lora"),
    "orchestrator": ("checkpoints", "timeouts", "orchestrator", "inference", "transport", "weight_sync", "trainer.lora",
                     "tracking"),
    "trainer": ("checkpoints", "timeouts", "trainer", "transport", "weight_sync"),
    "run": _ALL,
    "slurm": (*_ALL, "slurm"),
    "eval": ("orchestrator", "inference", "trainer.lora"),
    "sft": ("checkpoints", "sft", "trainer", "orchestrator.eval", "inference"),
}


class ProgramCommand(TyperCommand):
    """A command taking a config: its --help goes on to list the config keys with their docs."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help(ctx, formatter)  # with rich, printed here; the formatter's text follows
        from asyncrl.config_help import render_help

        width = min(shutil.get_terminal_size((80, 24)).columns, 100)  # as rich draws the usage: 80 off a terminal
        formatter.write(render_help(SECTIONS[self.name], width))


def preflight_checks(program: str) -> tuple:
    """The start-up checks of `program`: each program's own (its preflight.py, imported here
    only, as the programs themselves are) with the shared ones in them; `rl run` all three's."""
    from rl.preflight import slurm_template

    if program == "slurm":
        return (slurm_template,)
    if program == "sft":  # the data step's, the trainer's, and with sft.eval_generate rl eval's
        from inference.preflight import SERVING
        from orchestrator.preflight import EVAL_CHECKS, SFT_CHECKS
        from trainer.preflight import CHECKS

        return SFT_CHECKS + CHECKS + tuple(_when_generating(c) for c in SERVING + EVAL_CHECKS)
    if program == "eval":  # a server of its own, then the orchestrator's evaluation
        from inference.preflight import SERVING
        from orchestrator.preflight import EVAL_CHECKS

        return SERVING + EVAL_CHECKS
    import importlib

    programs = ("inference", "orchestrator", "trainer") if program == "run" else (program,)
    checks = tuple(dict.fromkeys(c for p in programs for c in importlib.import_module(f"{p}.preflight").CHECKS))
    if program == "run":  # which GPUs each program gets, and what cannot work on them
        from rl import gpu_placement

        checks += (gpu_placement.check,)
    return checks


def _when_generating(check: Callable[[RunConfig], None]) -> Callable[[RunConfig], None]:
    """One of `rl eval`'s checks, for `rl sft` when it evaluates by generation too."""

    def checked(cfg: RunConfig) -> None:
        if cfg.sft.eval_generate:
            check(cfg)

    return checked


def resolve(argv: list[str], program: str) -> RunConfig:
    return startup.resolve(argv, program, preflight_checks(program))


def _program(program: str, argv: list[str], main: Callable[[RunConfig], object], cores: str = "") -> None:
    startup.start(program, argv, main, preflight_checks(program), cores)


@app.command(cls=ProgramCommand, context_settings=_ARGS)
def inference(ctx: typer.Context) -> None:
    """Start a vLLM server with the admin routes (/health, /update_weights)."""

    def main(cfg: RunConfig) -> int:
        from inference.server import main as serve

        return serve(cfg)

    _program("inference", ctx.args, main)


@app.command(cls=ProgramCommand, context_settings=_ARGS)
def orchestrator(ctx: typer.Context) -> None:
    """Generate rollouts, score them, and hand batches to the trainer within the async bound."""

    def main(cfg: RunConfig) -> int:
        from orchestrator.main import main as run

        return run(cfg)

    _program("orchestrator", ctx.args, main)


@app.command(cls=ProgramCommand, context_settings=_ARGS)
def trainer(ctx: typer.Context) -> None:
    """Train with FSDP2 on each batch and publish weights/step_n (use torchrun for several ranks)."""

    def main(cfg: RunConfig) -> None:
        from trainer.main import main as run

        run(cfg)

    _program("trainer", ctx.args, main)


@app.command(cls=ProgramCommand, context_settings=_ARGS)
def sft(ctx: typer.Context) -> None:
    """Supervised fine-tuning on the assistant turns of sft.datasets, with the trainer's FSDP2 loop;
    weights/step_N is a model `rl run` starts from (torchrun --nproc-per-node N -m asyncrl sft: N ranks)."""

    def main(cfg: RunConfig) -> None:
        import contextlib

        from rl.preflight import is_rank0

        tracking = contextlib.nullcontext()
        if is_rank0():  # the other ranks wait for it in the process group's rendezvous
            from orchestrator.reporting.tracking import following
            from orchestrator.sft.data import prepare

            try:
                prepare(cfg)
            except ConfigError as e:
                typer.echo(f"rl sft: {e}", err=True)
                raise typer.Exit(2) from None
            tracking = following(cfg)  # wandb / TensorBoard, as the orchestrator feeds them in RL
        from asyncrl.eval_follower import EvalFollower
        from asyncrl.plots import write_plots
        from trainer.sft import main as train

        follower = EvalFollower(cfg, ctx.args) if cfg.sft.eval_generate and is_rank0() else None
        with tracking:
            try:
                train(cfg)
            except BaseException:
                if follower is not None:
                    follower.stop()
                raise
            if follower is not None:
                follower.finish()
        if is_rank0():
            write_plots(cfg.output_dir)

    _program("sft", ctx.args, main, cores="trainer")


@app.command(cls=ProgramCommand, context_settings=_ARGS)
def run(ctx: typer.Context) -> None:
    """Start inference, orchestrator and trainer locally; stop all if one fails."""
    cfg = resolve(ctx.args, "run")
    from asyncrl.launcher import launch

    raise typer.Exit(launch(cfg, ctx.args))


@app.command(cls=ProgramCommand, context_settings=_ARGS)
def slurm(ctx: typer.Context) -> None:
    """Print an sbatch script that runs this config on a SLURM cluster (see docs/slurm.md); with
    --submit, hand it to sbatch instead (the job starts in the current directory) and print its id."""
    argv = list(ctx.args)
    submitting = "--submit" in argv
    if submitting:
        argv.remove("--submit")
    cfg = resolve(argv, "slurm")
    from asyncrl.slurm import SlurmError, render, submit

    try:
        script, notes = render(cfg)
        job = submit(script) if submitting else None
    except SlurmError as e:
        typer.echo(f"rl slurm: {e}", err=True)
        raise typer.Exit(2) from None
    for note in notes:
        typer.echo(f"rl slurm: {note}", err=True)
    if job is None:
        typer.echo(script, nl=False)
    else:
        typer.echo(f"rl slurm: submitted job {job} (squeue -j {job}; its output: *-{job}.out here)", err=True)
        typer.echo(job)


@app.command("eval", cls=ProgramCommand, context_settings=_ARGS)
def evaluate(ctx: typer.Context) -> None:
    """Evaluate weights/step_N (--step N; several: --step 0,2,4, or --step all: the model and every
    published step) or the config's model on [orchestrator.eval] datasets, with a server of its
    own that reloads step after step; prints the numbers and appends one record per step to
    <output_dir>/evals.jsonl. --follow: step 0, then each step a run still training publishes,
    until max_steps, into its metrics.jsonl (what rl sft's sft.eval_generate starts)."""
    argv, steps = list(ctx.args), "0"
    following = "--follow" in argv
    if following:
        argv.remove("--follow")
    if "--step" in argv:
        i = argv.index("--step")
        steps = argv[i + 1] if i + 1 < len(argv) else ""
        argv = argv[:i] + argv[i + 2:]
        if steps != "all" and not all(part.isdigit() for part in steps.split(",")):
            typer.echo(f"rl eval: --step {steps!r}: expected a step number, several separated by commas, "
                       "or all", err=True)
            raise typer.Exit(2)
    cfg = resolve(argv, "eval")
    startup.setup_logging("eval")
    from orchestrator.evaluation.command import main as run_eval

    chosen = ([0, *RunDir(cfg.run_dir).stable_weight_steps()] if steps == "all"
              else [int(part) for part in steps.split(",")])
    raise typer.Exit(run_eval(cfg, argv, chosen, following))


@app.command()
def plot(output_dir: Path = typer.Argument(..., help="a run directory (holding metrics.jsonl)")) -> None:
    """Write the run's plots (reward and evaluation, staleness, throughput and idle time, weight
    updates, one curve per run of a multi-run) as PNGs into its directory."""
    from asyncrl.plots import write_plots

    if not (output_dir / "metrics.jsonl").is_file() and not list(output_dir.glob("runs/*/metrics.jsonl")):
        typer.echo(f"rl plot: {output_dir} holds no metrics.jsonl (is it a run's output_dir?)", err=True)
        raise typer.Exit(2)
    for path in write_plots(output_dir):
        typer.echo(str(path))


def main() -> None:
    app()
