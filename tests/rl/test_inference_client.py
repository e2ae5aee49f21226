"""InferenceClient (rl/inference_api.py) against a server that answers 200 with something that is
not the route's answer: an InferenceError naming the server and route, as for a cut connection,
so the callers that take a failing server out of rotation (they catch InferenceError) do so."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from conftest import free_port
from rl.inference_api import GenerateRequest, InferenceClient, InferenceError, connector

ANSWERS = {
    "/generate": (b"<html>a proxy's error page</html>", "text/html"),  # not JSON
    "/abort": (b'{"aborted": ', "application/json"),  # cut short
}


async def serve(port: int) -> web.AppRunner:
    async def answer(request: web.Request) -> web.Response:
        body, content_type = ANSWERS[request.path]
        return web.Response(body=body, content_type=content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.mark.parametrize("call, culprit", [
    (lambda c: c.generate(GenerateRequest(request_id="r", prompt_token_ids=[1, 2]), 5), "/generate"),
    (lambda c: c.abort(["r"], 5), "/abort"),
])
def test_an_answer_that_is_not_the_routes_is_an_inference_error_naming_it(call, culprit):
    async def main():
        port = free_port()
        runner = await serve(port)
        try:
            async with aiohttp.ClientSession(connector=connector()) as session:
                client = InferenceClient(f"http://127.0.0.1:{port}", session)
                with pytest.raises(InferenceError, match=rf"^http://127\.0\.0\.1:{port}{culprit}: a bad answer: "):
                    await call(client)
        finally:
            await runner.cleanup()

    asyncio.run(main())
