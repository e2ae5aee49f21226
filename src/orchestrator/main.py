"""`rl orchestrator`: the orchestrator program (the scheduling: orchestrator/orchestrator.py).

    rl orchestrator @ configs/demo.toml
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

import aiohttp

from orchestrator import prometheus
from orchestrator.orchestrator import Orchestrator
from orchestrator.sandbox import OUTCOME_LISTENERS
from orchestrator.streaks import Spinning
from rl.config import RunConfig
from rl.inference_api import connector
from rl.rundir import RunDir

log = logging.getLogger("orchestrator")


def tune_gc() -> None:
    """The orchestrator allocates many short-lived lists (token ids, logprobs) per group, so the
    cyclic collector runs often; each full pass would also walk every long-lived object left
    behind at start (modules, the config, the tokenizer). Freezing those and collecting the young
    generation less often doubled the groups scheduled per second (measured when torch was still
    imported here: 370k tracked objects then, 52k now)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def _main(cfg: RunConfig) -> None:
    # SIGTERM (the launcher's, or a user's kill) stops like Ctrl-C: through run()'s cleanup,
    # which aborts requests on the servers, unloads adapters and removes the heartbeat.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    conns = connector(limit=cfg.orchestrator.scheduling.max_in_flight_groups * cfg.orchestrator.scheduling.group_size + 16)
    async with aiohttp.ClientSession(connector=conns) as session:
        orchestrator = Orchestrator(cfg, session)
        tune_gc()
        await orchestrator.run()


def main(cfg: RunConfig) -> int:
    if cfg.trainer.lora.multi_run and not cfg.run_name:
        log.error("trainer.lora.multi_run = true: this orchestrator needs run_name (its run's name, "
                  "e.g. compose configs/lora_multi/reverse.toml)")
        return 2
    RunDir(cfg.run_dir).make()
    OUTCOME_LISTENERS.append(prometheus.sandbox_run)  # the programs rewards run, by outcome
    try:
        asyncio.run(_main(cfg))
    except asyncio.CancelledError:
        log.warning("stopped by SIGTERM")
        return 128 + signal.SIGTERM
    except (TimeoutError, Spinning) as e:
        # A wait reached its configured timeout, or the run could only spin (orchestrator/streaks.py):
        # the message names what and which key; a traceback would bury that line under forty others.
        log.error("%s", e)
        return 1
    return 0
