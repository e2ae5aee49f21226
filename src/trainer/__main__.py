"""`torchrun --nproc-per-node N -m trainer @ cfg.toml`: the trainer under torchrun."""

import sys

from rl.cli.main import app

app(["trainer", *sys.argv[1:]])
