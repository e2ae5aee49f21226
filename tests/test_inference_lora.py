"""LoRA adapters on the inference server (POST /load_lora_adapter, /unload_lora_adapter and
/generate {"lora"}) against a real vLLM server: outputs match the peft model token for token,
adapters and base requests share batches, versions come from the adapter, paths are confined."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from conftest import TINY_MODEL
from rl.config import RunConfig
from rl.rundir import RunDir
from test_end_to_end import start_server

pytestmark = pytest.mark.slow

Z, EQ, EOS = 28, 29, 1  # "z", "=" and <eos> in the char tokenizer (vocab 30)
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, EQ], [10, 7, 14, 14, 17, EQ], [26, 27, 28, EQ]]
MAX_TOKENS = 24
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_LORAS = 3


def peft_adapter(seed: int, out, rank: int = 8):
    """A LoRA adapter on the tiny model whose lora_B is random (peft starts it at zero, which
    would change nothing), saved to `out`; returns the peft model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=16, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(out)
    return model.eval()


def greedy_reference(model, prompts) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs (temperature 1, as vLLM reports for greedy requests)."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, tokens, logprobs = list(prompt), [], []
            for _ in range(MAX_TOKENS):
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                t = int(lp.argmax())
                tokens.append(t)
                logprobs.append(float(lp[t]))
                ids.append(t)
                if t == EOS:
                    break
            out.append((tokens, logprobs))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    run = RunDir(tmp / "run")
    extra = f"max_loras = {MAX_LORAS}\n[trainer.lora]\nrank = 8\n"
    with ThreadPoolExecutor(1) as pool:
        # The server starts (~30 s) while the adapters and their references are computed.
        started = pool.submit(start_server, tmp, "server", TINY_MODEL, run.root, extra)
        try:
            a_dir, b_dir = run.weights_dir(1), run.root / "runs" / "b" / "weights" / "step_2"
            a, b = peft_adapter(1, a_dir), peft_adapter(2, b_dir)
            with a.disable_adapter():
                base_ref = greedy_reference(a, PROMPTS)
            refs = {"a": greedy_reference(a, PROMPTS), "b": greedy_reference(b, PROMPTS), None: base_ref}
            # Above the server's --max-lora-rank (8): files in order, the engine refuses them.
            too_big = run.weights_dir(16)
            peft_adapter(3, too_big, rank=16)
            empty = run.weights_dir(9)
            empty.mkdir(parents=True)
            (empty / "adapter_config.json").write_text("{}")
            outside = tmp / "outside"
            shutil.copytree(a_dir, outside)
        finally:
            proc, url = started.result()
    try:
        yield {"url": url, "a": str(a_dir), "b": str(b_dir), "refs": refs, "empty": str(empty), "too_big": str(too_big),
               "outside": str(outside), "run": run}
    finally:
        proc.stop()


def post(url: str, route: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(f"{url}{route}", json=body, timeout=120)
    return r.status_code, r.json()


def message(answer: dict) -> str:
    return answer["error"]["message"]


async def generate_all(url: str, requests: list[tuple[str, str | None, list[int]]]) -> dict:
    """Every (request_id, lora, prompt) at once: the engine batches them together."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(request_id, lora, prompt):
            body = {"request_id": request_id, "prompt_token_ids": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0}
            if lora is not None:
                body["lora"] = lora
            r = await client.post(f"{url}/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()["samples"][0]

        samples = await asyncio.gather(*(one(*r) for r in requests))
    return {r[0]: s for r, s in zip(requests, samples)}


def assert_matches(sample: dict, reference: tuple[list[int], list[float]]) -> None:
    tokens, logprobs = reference
    assert sample["token_ids"] == tokens
    assert sample["logprobs"] == pytest.approx(logprobs, abs=1e-4)


def test_an_adapter_generates_what_the_peft_model_does(server):
    url, refs = server["url"], server["refs"]
    status, answer = post(url, "/load_lora_adapter", {"name": "a", "path": server["a"], "version": 1})
    assert status == 200, answer
    assert answer["name"] == "a" and answer["version"] == 1 and answer["load_s"] >= 0
    out = asyncio.run(generate_all(url, [(f"{lora}-{i}", lora, p) for lora in ("a", None)
                                         for i, p in enumerate(PROMPTS)]))
    for i in range(len(PROMPTS)):
        lora, base = out[f"a-{i}"], out[f"None-{i}"]
        assert_matches(lora, refs["a"][i])
        assert_matches(base, refs[None][i])
        assert lora["versions"] == [1] * len(lora["token_ids"])
        assert base["versions"] == [0] * len(base["token_ids"])
    # The adapter changes what the model writes.
    assert [r[0] for r in refs["a"]] != [r[0] for r in refs[None]]


def test_two_adapters_and_the_base_model_in_one_batch(server):
    url, refs = server["url"], server["refs"]
    status, answer = post(url, "/load_lora_adapter", {"name": "b", "path": server["b"], "version": 2})
    assert status == 200, answer
    health = httpx.get(f"{url}/health").json()
    assert health["adapters"] == {"a": 1, "b": 2} and health["version"] == 0
    out = asyncio.run(generate_all(url, [(f"{lora}-{i}", lora, p) for i, p in enumerate(PROMPTS)
                                         for lora in ("a", "b", None)]))
    for i in range(len(PROMPTS)):
        for lora, version in (("a", 1), ("b", 2), (None, 0)):
            sample = out[f"{lora}-{i}"]
            assert_matches(sample, refs[lora][i])
            assert sample["versions"] == [version] * len(sample["token_ids"])


def test_load_refusals(server):
    url, run = server["url"], server["run"]
    model_dir = str(TINY_MODEL)
    cases = {
        "outside (model)": ({"name": "x", "path": model_dir, "version": 0}, 403, "path:"),
        "outside (tmp)": ({"name": "x", "path": server["outside"], "version": 0}, 403, "path:"),
        "escape": ({"name": "x", "path": f"{run.weights}/../../outside", "version": 0}, 403, "path:"),
        "runs, not weights": ({"name": "x", "path": str(run.root / "runs" / "b"), "version": 0}, 403, "path:"),
        "missing": ({"name": "x", "path": str(run.weights_dir(8)), "version": 0}, 404, "path:"),
        "no safetensors": ({"name": "x", "path": server["empty"], "version": 0}, 422,
                           "adapter_model.safetensors"),
        "no config": ({"name": "x", "path": str(run.weights), "version": 0}, 422, "adapter_config.json"),
        "rank 16": ({"name": "x", "path": server["too_big"], "version": 0}, 422, "max_lora_rank 8"),
        "same name, other version": ({"name": "a", "path": server["a"], "version": 3}, 409, "name:"),
        "same name, other path": ({"name": "a", "path": server["b"], "version": 1}, 409, "name:"),
        "bad name": ({"name": "a/b", "path": server["a"], "version": 1}, 400, "name"),
        "negative version": ({"name": "x", "path": server["a"], "version": -1}, 400, "version"),
    }
    for case, (body, want_status, want_text) in cases.items():
        status, answer = post(url, "/load_lora_adapter", body)
        assert status == want_status, (case, answer)
        assert want_text in message(answer), (case, answer)
    # The same adapter again: nothing to do.
    status, answer = post(url, "/load_lora_adapter", {"name": "a", "path": server["a"], "version": 1})
    assert status == 200 and answer["already"] and answer["load_s"] == 0.0, answer
    # max_loras (3): a third fits, a fourth is refused.
    status, answer = post(url, "/load_lora_adapter", {"name": "a2", "path": server["a"], "version": 1})
    assert status == 200, answer
    status, answer = post(url, "/load_lora_adapter", {"name": "d", "path": server["b"], "version": 1})
    assert status == 409 and "unload one first" in message(answer), answer
    assert post(url, "/unload_lora_adapter", {"name": "a2"})[0] == 200
    status, answer = post(url, "/generate", {"request_id": "u", "prompt_token_ids": [Z], "lora": "nope"})
    assert status == 404 and message(answer).startswith("lora:"), answer
    status, answer = post(url, "/unload_lora_adapter", {"name": "nope"})
    assert status == 404 and message(answer).startswith("name:"), answer
    assert httpx.get(f"{url}/health").json()["adapters"] == {"a": 1, "b": 2}


def test_unload_waits_for_no_generate_and_a_name_can_be_loaded_again(server):
    url, refs = server["url"], server["refs"]

    async def busy_unload():
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.create_task(client.post(f"{url}/generate", json={
                "request_id": "long", "prompt_token_ids": [Z], "n": 32, "max_tokens": 63, "lora": "a"}))
            while (await client.get(f"{url}/health")).json()["running"] == 0:
                assert not task.done(), (await task).text
                await asyncio.sleep(0.005)
            busy = await client.post(f"{url}/unload_lora_adapter", json={"name": "a"})
            long = await task
            return busy, long

    busy, long = asyncio.run(busy_unload())
    assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"], busy.text
    assert long.status_code == 200
    assert all(s["versions"] == [1] * len(s["token_ids"]) for s in long.json()["samples"])

    status, answer = post(url, "/unload_lora_adapter", {"name": "a"})
    assert status == 200 and answer == {"name": "a", "version": 1}, answer
    status, answer = post(url, "/generate", {"request_id": "gone", "prompt_token_ids": PROMPTS[0], "lora": "a"})
    assert status == 404 and "lora:" in message(answer), answer
    assert httpx.get(f"{url}/health").json()["adapters"] == {"b": 2}

    # The name again, now for b's weights as version 5: nothing of the old "a" is reused.
    status, answer = post(url, "/load_lora_adapter", {"name": "a", "path": server["b"], "version": 5})
    assert status == 200 and not answer["already"], answer
    out = asyncio.run(generate_all(url, [(f"again-{i}", "a", p) for i, p in enumerate(PROMPTS)]))
    for i in range(len(PROMPTS)):
        assert_matches(out[f"again-{i}"], refs["b"][i])
        assert out[f"again-{i}"]["versions"] == [5] * len(out[f"again-{i}"]["token_ids"])


def test_lora_off_and_vllm_args(tmp_path):
    """Without a server: the 400 without LoRA, and the flags vLLM gets."""
    from inference.routes import Routes as AdminRoutes
    from inference.server import vllm_args

    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(tmp_path)})
    assert "--enable-lora" not in vllm_args(cfg)
    app = FastAPI()
    app.include_router(AdminRoutes(cfg).router())
    r = TestClient(app).post("/load_lora_adapter", json={"name": "a", "path": str(tmp_path), "version": 1})
    assert r.status_code == 400 and "trainer.lora.rank" in r.json()["detail"]

    for rank, max_rank in ((1, 1), (2, 8), (8, 8), (9, 16), (300, 320), (512, 512)):
        cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "trainer": {"lora": {"rank": rank}},
                                        "inference": {"max_loras": 5}})
        args = vllm_args(cfg)
        assert "--enable-lora" in args
        flags = dict(zip(args, args[1:]))
        assert flags["--max-lora-rank"] == str(max_rank)
        assert flags["--max-loras"] == flags["--max-cpu-loras"] == "5"

    # Confinement, symlinks resolved first.
    routes = AdminRoutes(RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(tmp_path / "out"),
                                                   "trainer": {"lora": {"rank": 8}}}))
    (tmp_path / "out" / "weights").mkdir(parents=True)
    (tmp_path / "out" / "weights" / "link").symlink_to(TINY_MODEL)
    with pytest.raises(HTTPException) as e:
        routes.confine_adapter(str(tmp_path / "out" / "weights" / "link"))
    assert e.value.status_code == 403
