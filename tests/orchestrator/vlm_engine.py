"""One real `rl inference` (vLLM CPU) on models/tiny-vlm for the orchestrator's picture tests:
the first of test_agent_images.py and test_turn_images.py to need it starts it (a free port),
plays every kind's episodes on it (an agent's, the built-in tool loop's, a text environment's)
and stops it, so that the trainer runs after it have the cores; the other module of the same
process reads the same results (under xdist, a worker that runs only one of them starts its own)."""

from __future__ import annotations

import asyncio

PLAYED: dict = {}


def played_on_engine(tmp_path_factory) -> dict:
    """{"agent": ..., "tools": ..., "turns": ..., "tmp": a folder}: what each module's player
    returned (test_agent_images.play_agents, test_turn_images.play_tools and play_turns)."""
    if PLAYED:
        return PLAYED
    import aiohttp

    from rl.inference_api import InferenceClient
    from test_agent_images import SEQ_LEN, VLM, play_agents
    from programs import launch_server, wait_healthy
    from test_turn_images import play_tools, play_turns

    tmp = tmp_path_factory.mktemp("vlm_engine")
    proc, url = launch_server(tmp, "server", VLM, tmp / "run", seq_len=SEQ_LEN)
    try:
        wait_healthy(proc, url)

        async def main() -> dict:
            async with aiohttp.ClientSession() as session:
                client = InferenceClient(url, session)

                async def generate(request):
                    return await client.generate(request, timeout=120)

                return {"agent": await play_agents(generate), "tools": await play_tools(generate),
                        "turns": await play_turns(generate)}

        PLAYED.update(asyncio.run(main()), tmp=tmp)
    finally:
        proc.stop()
    return PLAYED
