"""`rl trainer`: the trainer program (trainer/trainer.py; multi-run LoRA: trainer/runs.py).

    rl trainer @ configs/demo.toml [--resume]
    torchrun --nproc-per-node 2 -m trainer @ configs/demo.toml
"""

from __future__ import annotations

import logging
import signal

import torch.distributed as dist

from rl.config import RunConfig
from rl.stop_signal import raise_on_sigterm
from trainer.runs import MultiRun
from trainer.trainer import Trainer

log = logging.getLogger("trainer")


def main(cfg: RunConfig) -> None:
    # SIGTERM unwinds like an error: receivers close, the process group is destroyed, and the
    # heartbeat file goes, so peers read "stopped" rather than wait out a silence.
    raise_on_sigterm(lambda: SystemExit(128 + signal.SIGTERM))
    trainer = Trainer(cfg)
    try:
        if cfg.trainer.lora.multi_run:
            MultiRun(trainer).serve()
        else:
            trainer.train()
    except TimeoutError as e:
        # A wait reached its configured timeout: its message names what and which key; a
        # traceback would bury that line under forty others.
        log.error("%s", e)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()
