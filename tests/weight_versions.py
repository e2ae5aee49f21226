"""Weight versions as a test makes them: the tiny model's tensors after n sparse steps (what the
trainer hands its publisher), the trainer's FilePublisher writing them as full files or deltas,
and the HTTP calls a test makes to a server about versions (update, greedy ids and logprobs,
the version it serves). Shared by the delta, delta-broadcast and reload-all-workers tests."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
from safetensors.torch import load_file

from conftest import TINY_MODEL
from rl.config import RunConfig
from rl.rundir import RunDir


PROMPTS = ([3, 4, 5, 29], [10, 11, 29], [28, 27, 26, 25, 29])
EMBED = "model.embed_tokens.weight"


def step_tensors(step: int) -> dict[str, torch.Tensor]:
    """The tiny model's tensors after `step` sparse updates (3% of each tensor's values a step,
    the same ones moved again at times): what gather_full_state_dict hands over, lm_head included."""
    tensors = dict(_stepped(step))
    return {**tensors, "lm_head.weight": tensors[EMBED]}


@functools.lru_cache(maxsize=None)
def _stepped(step: int) -> tuple[tuple[str, torch.Tensor], ...]:
    """Each step from the one before (cached: the tests ask for the same steps many times)."""
    if step <= 1:
        return tuple(sorted(load_file(TINY_MODEL / "model.safetensors").items()))
    g = torch.Generator().manual_seed(step)
    out = []
    for name, t in _stepped(step - 1):
        t = t.clone()
        flat = t.view(-1)
        picked = torch.rand(flat.shape, generator=g) < 0.03
        flat[picked] += 0.05 * torch.randn(int(picked.sum()), generator=g)
        out.append((name, t))
    return tuple(out)


def publisher(run: RunDir, full_every: int = 8, keep: int = 3):
    from trainer.publish import FilePublisher

    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(run.root),
                                    "inference": {"dtype": "float32"},
                                    "weight_sync": {"delta": True, "full_every": full_every},
                                    "trainer": {"files": {"keep_weights": keep}}})
    pub = FilePublisher(0, None, cfg, run, tied=True)
    return pub, SimpleNamespace(cfg=cfg, run=run)


def update(url: str, path: Path, version: int) -> tuple[int, str]:
    r = httpx.post(f"{url}/update_weights", json={"path": str(path), "version": version, "mode": "wait"}, timeout=120)
    return r.status_code, r.text


def greedy(url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        r = httpx.post(f"{url}/generate", timeout=60, json={"request_id": f"g{time.monotonic_ns()}-{i}",
                                                            "prompt_token_ids": list(prompt), "max_tokens": 12,
                                                            "temperature": 0})
        assert r.status_code == 200, r.text
        sample = r.json()["samples"][0]
        out.append((sample["token_ids"], sample["logprobs"]))
    return out


def detail(text: str) -> str:
    """The message of an error answer (vLLM's handler renders every HTTPException)."""
    return json.loads(text)["error"]["message"]


def serving(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["version"]
