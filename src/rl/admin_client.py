"""Client side of the inference server's admin routes (served by inference/server.py)."""

from __future__ import annotations

import httpx


class AdminError(Exception):
    """An admin call that failed; the message names the server and the route."""


class AdminClient:
    def __init__(self, url: str, client: httpx.AsyncClient, token: str | None = None):
        self.url = url.rstrip("/")
        self.client = client
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def health(self, timeout: float = 5.0) -> dict:
        """{"status", "version", "path"}; raises AdminError when the server is down or unhealthy."""
        try:
            r = await self.client.get(f"{self.url}/health", timeout=timeout)
        except httpx.HTTPError as e:
            raise AdminError(f"{self.url}/health: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise AdminError(f"{self.url}/health: HTTP {r.status_code}")
        return r.json()

    async def update_weights(self, path: str, version: int, timeout: float) -> dict:
        """Reload weights from `path` in place; returns once the server serves `version`."""
        try:
            r = await self.client.post(
                f"{self.url}/update_weights", json={"path": path, "version": version},
                headers=self.headers, timeout=timeout,
            )
        except httpx.HTTPError as e:
            raise AdminError(f"{self.url}/update_weights: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise AdminError(f"{self.url}/update_weights: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    async def model_name(self, timeout: float = 10.0) -> str:
        r = await self.client.get(f"{self.url}/v1/models", timeout=timeout)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
