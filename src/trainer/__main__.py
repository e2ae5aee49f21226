"""`torchrun --nproc-per-node N -m trainer @ cfg.toml`: the trainer under torchrun, started as
`rl trainer` starts it (rl/startup.py), without the command line."""

import sys

from rl.startup import start
from trainer.preflight import CHECKS


def _main(cfg):
    from trainer.main import main

    return main(cfg)


start("trainer", sys.argv[1:], _main, CHECKS)
