"""The policy version on vLLM's OpenAI routes (/v1/chat/completions, /v1/completions): each
answer carries two headers,

    x-asyncrl-version-start   the weights version serving when the request arrived
    x-asyncrl-version         the version serving when the answer started (for a non-streamed
                              answer: after its last token; for a stream: at its first chunk)

Versions only grow, so equal values mean every token of a non-streamed answer was sampled by that
one version; different values mean an update landed while it generated (which token switched is
/generate's to say: it tags every token). An agent using the OpenAI client reads them from the
raw response (`client.chat.completions.with_raw_response.create(...)`).

A pure ASGI middleware: it touches only the response's start message, so streams and
cancellations pass through as vLLM sends them.
"""

from __future__ import annotations

from collections.abc import Callable

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")
START, END = b"x-asyncrl-version-start", b"x-asyncrl-version"


class VersionHeaders:
    def __init__(self, app, version: Callable[[], int]):
        self.app = app
        self.version = version

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in OPENAI_PATHS:
            return await self.app(scope, receive, send)
        start = str(self.version()).encode()

        async def tagged(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(START, start), (END, str(self.version()).encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, tagged)
