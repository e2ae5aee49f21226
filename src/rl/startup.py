"""How every program starts, whoever starts it (`rl <program>`, `torchrun -m trainer`): the config
parsed and checked before anything is written or started (one line naming the culprit, exit 2),
the program pinned to its CPUs and GPUs, its resolved config saved, its heartbeat beating, then
its main. The checks are the caller's: each program owns its own (its preflight.py), and the
command line picks them, so this foundation imports no program."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Iterable

from rl.config import ConfigError, RunConfig, load_config

Check = Callable[[RunConfig], None]


def setup_logging(program: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {program} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def resolve(argv: list[str], program: str, checks: Iterable[Check]) -> RunConfig:
    """Parse, validate and check what the config names (rl/preflight.py), or exit 2 with one line
    naming the culprit, before anything is written or started. --dry-run prints and exits 0."""
    try:
        cfg, dry_run = load_config(argv)
        from rl.preflight import check

        check(cfg, tuple(checks))
    except ConfigError as e:
        print(f"rl {program}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if dry_run:
        from rl.resolved_config import render_toml

        print(render_toml(cfg), end="")
        if program == "run":
            from rl.gpu_placement import check as gpu_plan

            placed = gpu_plan(cfg)
            print(f"rl run: {placed.describe() if placed else 'no GPU visible: every program on CPU'}", file=sys.stderr)
        print(f"rl {program}: config and start-up checks passed", file=sys.stderr)
        raise SystemExit(0)
    return cfg


def start(program: str, argv: list[str], main: Callable[[RunConfig], object], checks: Iterable[Check],
          cores: str = "") -> None:
    """Resolve, then run `main(cfg)` and exit with its code. `cores`: the table whose `cpus` pin
    the program (default: its own)."""
    cfg = resolve(argv, program, checks)
    from rl.placement import pin

    table = cores or program
    pin(f"{table}.cpus", getattr(cfg, table).cpus)  # checked by resolve
    if table in ("inference", "trainer"):
        from rl.gpu_placement import apply

        apply(cfg, table)  # before torch or vLLM sees a GPU (the ids checked by resolve)
    setup_logging(program)
    from rl.heartbeat import Heartbeat, heartbeat_path
    from rl.resolved_config import save_resolved

    rank = os.environ.get("RANK", "0")  # set by torchrun: a trainer rank, maybe on another node
    if rank == "0":
        save_resolved(cfg, program)
    # First thing, before the heavy imports: peers and `rl run` see the program from its start.
    # Every trainer rank beats (trainer-rank<r> besides rank 0's "trainer"), so that a node cut
    # off is named even while rank 0 sits in a collective waiting for it.
    name = program if rank == "0" else f"{program}-rank{rank}"
    url = cfg.inference.url if program == "inference" else None
    heartbeat = Heartbeat(heartbeat_path(cfg, name), url=url).start()
    try:
        code = main(cfg)
    finally:
        heartbeat.stop()
    raise SystemExit(int(code or 0))
