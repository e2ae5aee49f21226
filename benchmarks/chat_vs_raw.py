"""Rollouts per second through the chat path against the raw path, on the same model and real
vLLM server: the demo's chat model (models/tiny-chat) on reasoning-gym spell_backward rows,
prompts rendered by its chat template (orchestrator.prompts.chat = "on") or sent as raw text ("off").
Everything the orchestrator does per group is in the loop (rendering, tokenizing, the request,
detokenizing, the task's scorer, advantages); 16 groups of 8 in flight at once. Also the
orchestrator's own cost of turning one row into prompt ids, without a server.

    .venv/bin/python benchmarks/chat_vs_raw.py [--groups 200] [--rounds 2]

Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402

from orchestrator.prompts.queue import PromptQueue  # noqa: E402
from orchestrator.rollout.groups import Rollouts  # noqa: E402
from orchestrator.rewards.registry import make_reward  # noqa: E402
from orchestrator.prompts.dataset_mix import Source, mix  # noqa: E402
from orchestrator.rendering.tokenizer import load_tokenizer  # noqa: E402
from rl.config import RunConfig  # noqa: E402
from rl.inference_api import InferenceClient  # noqa: E402
from test_end_to_end import launch_server, wait_healthy  # noqa: E402

MODEL = ROOT / "models" / "tiny-chat"
IN_FLIGHT = 16


def config(chat: str) -> RunConfig:
    return RunConfig.model_validate({"model": str(MODEL), "seq_len": 64, "orchestrator": {
        "prompts": {"chat": chat}, "scheduling": {"group_size": 8}, "sampling": {"max_tokens": 10, "temperature": 0.7},
        "datasets": [{"reasoning_gym": "spell_backward", "task_config": {"min_word_len": 3, "max_word_len": 7}}]}})


async def rollouts_per_s(url: str, chat: str, groups: int) -> dict:
    cfg = config(chat)
    async with aiohttp.ClientSession() as session:
        sources = {d.name: Source(d, cfg.seed) for d in cfg.orchestrator.resolved_datasets()}
        rewards = {name: make_reward(s.ds.reward, 60, session, key="reward") for name, s in sources.items()}
        rollouts = Rollouts(cfg, load_tokenizer(str(MODEL)), sources, None, None, rewards)
        queue = PromptQueue(mix(list(sources.values()), cfg.seed), lambda n, d: sources[n].fetch(d))
        client = InferenceClient(url, session)
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(i: int):
            async with gate:
                return await rollouts.group(queue.take(), f"{chat}-{i}", lambda r: client.generate(r, 60))

        start = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(groups)))
        wall = time.perf_counter() - start
    samples = [s for g in done for s in g.samples]
    prompt = sum(len(s.tokens) - s.num_model_tokens for s in samples) / len(samples)
    completion = sum(s.num_model_tokens for s in samples) / len(samples)
    return {"rollouts_per_s": len(samples) / wall, "prompt_tokens": prompt, "completion_tokens": completion,
            "tokens_per_s": sum(len(s.tokens) for s in samples) / wall,
            "reward": sum(s.reward for s in samples) / len(samples)}


def render_cost_us(chat: str, rows: int = 2000) -> float:
    cfg = config(chat)
    source = Source(cfg.orchestrator.resolved_datasets()[0], cfg.seed)
    rollouts = Rollouts(cfg, load_tokenizer(str(MODEL)), {source.name: source}, None, None)
    fetched = [source.fetch(i) for i in range(rows)]
    start = time.perf_counter()
    for row, where in fetched:
        rollouts.renderer.render(source.ds, row, where)
    return (time.perf_counter() - start) / rows * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two paths (drift shows as spread)")
    args = ap.parse_args()
    for chat in ("on", "off"):
        print(f"render + tokenize one row, chat {chat}: {render_cost_us(chat):.1f} us")
    with tempfile.TemporaryDirectory() as tmp:
        server, url = launch_server(Path(tmp), "bench", MODEL, Path(tmp) / "run")
        try:
            wait_healthy(server, url)
            asyncio.run(rollouts_per_s(url, "on", 32))  # warm-up: the engine's first batches are slow
            for r in range(args.rounds):
                for chat in ("on", "off"):
                    m = asyncio.run(rollouts_per_s(url, chat, args.groups))
                    print(f"round {r} chat {chat}: {m['rollouts_per_s']:.0f} rollouts/s, {m['tokens_per_s']:.0f} tok/s, "
                          f"prompt {m['prompt_tokens']:.1f} + completion {m['completion_tokens']:.1f} tokens, "
                          f"reward {m['reward']:.3f}", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
