"""The inference server's own routes (rl/inference_api.py) against a real vLLM server: token-in
token-out generation, abort, in-flight weight updates with exact per-token versions, health; and
its readiness line, true the moment it appears (the fixture's first request)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time

import aiohttp
import openai
import psutil
import pytest
from safetensors.torch import load_file, save_file

from conftest import TINY_MODEL
from programs import Program, launch_server, wait_healthy
from rl.heartbeat import server_heartbeat_path
from rl.inference_api import connector
from rl.rundir import RunDir
from server_calls import post, wait_running


pytestmark = pytest.mark.slow

SEQ_LEN = 256  # the server's: long greedy runs (~3 s for MAX_NUM_SEQS) outlast any poll
Z, A, EQ = 28, 3, 29  # "z", "a", "=" in the char tokenizer (vocab 30)
# Greedy on "z" the tiny model writes "z" until max_tokens, never <eos>: long, deterministic runs.
LONG = {"prompt_token_ids": [Z], "max_tokens": SEQ_LEN - 1, "temperature": 0}
MAX_NUM_SEQS = 128  # vLLM's default for a CPU server: more requests than this wait in a queue
READY_LINE = re.compile(r" inference INFO ready: serving \S+ on http://")  # what README tells users to wait for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inference")
    run = RunDir(tmp / "run")
    # Weights whose logits are all zero (final norm zeroed): greedy then writes token 0 forever,
    # so every token shows which weights sampled it.
    zero = run.weights_dir(1)
    shutil.copytree(TINY_MODEL, zero)
    tensors = load_file(zero / "model.safetensors")
    tensors["model.norm.weight"].zero_()
    save_file(tensors, zero / "model.safetensors")
    proc, url = launch_server(tmp, "server", TINY_MODEL, run.root, seq_len=SEQ_LEN)
    try:
        first = complete_right_after_the_ready_line(proc, url, str(TINY_MODEL))
        wait_healthy(proc, url)
        # The engine's first batches are several times slower: keep them out of the timings.
        asyncio.run(_warm_up(url))
        yield {"url": url, "zero": str(zero), "model": str(TINY_MODEL), "first_completion": first,
               "pid": proc.proc.pid, "log": proc.log, "root": run.root}
    finally:
        proc.stop()


def complete_right_after_the_ready_line(proc: Program, url: str, model: str):
    """Wait for the line users are told to wait for ("ready: serving ..."), then at once ask the official
    OpenAI client for a completion, with no retries, so that a port not yet accepting shows (it
    did: "Connection error"). Returns the completion, or the error."""
    deadline = time.monotonic() + 240
    while not READY_LINE.search(proc.log.read_text(errors="replace")):
        assert proc.proc.poll() is None, proc.tail()
        assert time.monotonic() < deadline, f"no readiness line:\n{proc.tail()}"
        time.sleep(0.02)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        return client.completions.create(model=model, prompt="abc=", max_tokens=4, temperature=0)
    except openai.APIError as e:
        return e


async def _warm_up(url: str) -> None:
    async with aiohttp.ClientSession(connector=connector()) as s:
        await generate(s, url, "warm-up", n=MAX_NUM_SEQS, **LONG)


async def generate(s, url: str, request_id: str, **body) -> dict:
    status, data = await post(s, f"{url}/generate", {"request_id": request_id, **body})
    assert status == 200, data
    return data


async def all_running(s, url: str, request_id: str, attempts: int = 3) -> asyncio.Task:
    """Start MAX_NUM_SEQS long requests; return their task once vLLM's gauge shows every one
    running. The gauge moves only when the server's output loop runs: on a loaded machine that
    loop can be starved through a whole run, so no poll sees it (CI did, once). Such a run
    is started again under a new id: the test needs its requests caught running, not that run."""
    for attempt in range(attempts):
        task = asyncio.create_task(generate(s, url, f"{request_id}-{attempt}", n=MAX_NUM_SEQS,
                                            **LONG))
        if await wait_running(s, url, lambda c: c == MAX_NUM_SEQS, task=task) is not None:
            return task
        task.result()  # a request that failed fails the test here, with its error
    raise AssertionError(f"{attempts} runs of {MAX_NUM_SEQS} requests ended before /metrics "
                         "showed them all running")


async def health(s, url: str) -> dict:
    async with s.get(f"{url}/health") as r:
        return await r.json()


def test_the_readiness_line_is_true_an_openai_client_gets_a_completion_at_once(server):
    first = server["first_completion"]
    assert not isinstance(first, Exception), f"{type(first).__name__}: {first}"
    assert len(first.choices) == 1 and first.choices[0].finish_reason in ("stop", "length")


def test_a_cpu_engine_runs_its_worker_in_the_engine_core_on_the_bound_cores(server):
    """inference.one_process_engine (default): vLLM's engine core computes itself, no worker
    process beside it, on the cores $VLLM_CPU_OMP_THREADS_BIND names (conftest sets one per
    xdist worker) or, unset, on the cores this test may use."""
    names = [p.name() for p in psutil.Process(server["pid"]).children(recursive=True)]
    assert names.count("VLLM::EngineCore") == 1 and not [n for n in names if "Worker" in n], names
    (core,) = [p for p in psutil.Process(server["pid"]).children(recursive=True) if p.name() == "VLLM::EngineCore"]
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    want = {int(c) for c in bind.split(",")} if bind else os.sched_getaffinity(0)
    assert set(core.cpu_affinity()) == want


def test_an_eager_cpu_engine_runs_with_torch_compile_off(server):
    """inference/device_defaults.py compile_off: the server starts vLLM with TORCH_COMPILE_DISABLE=1
    (its first logprobs request would otherwise compile vLLM's rank helper with inductor), and
    vLLM says it read it (the engine core's own environment is not readable: its process title
    overwrites it)."""
    assert "TORCH_COMPILE_DISABLE is set, disabling torch.compile" in server["log"].read_text(errors="replace")


def test_images_for_a_text_only_model_are_refused_by_field(server):
    """inference/multimodal.py: one line naming the field, before anything reaches the engine."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")

    async def main():
        async with aiohttp.ClientSession() as s:
            return await post(s, f"{server['url']}/generate", {
                "request_id": "text-only-images", "prompt_token_ids": [Z], "max_tokens": 1,
                "images": [base64.b64encode(buf.getvalue()).decode()]})

    status, body = asyncio.run(main())
    assert status == 400 and body["error"]["message"].startswith("images: the model ("), body
    assert "reads text only" in body["error"]["message"]


def test_generate_returns_tokens_logprobs_and_versions(server):
    url = server["url"]
    prompt = [A, 4, 5, 6, EQ]  # "abcd="

    async def main():
        async with aiohttp.ClientSession(connector=connector()) as s:
            out = await generate(s, url, "a", prompt_token_ids=prompt, n=5, max_tokens=20,
                                 prompt_logprobs=True)
            greedy = await generate(s, url, "g", prompt_token_ids=prompt, max_tokens=20,
                                    temperature=0)
            status, openai = await post(s, f"{url}/v1/completions", {
                "model": server["model"], "prompt": prompt, "max_tokens": 20, "temperature": 0,
                "logprobs": 0, "return_token_ids": True})
            assert status == 200, openai
            errors = [await post(s, f"{url}/generate", {"request_id": "e", **body}) for body in (
                {"prompt_token_ids": [A] * (SEQ_LEN - 4), "max_tokens": 16},
                {"prompt_token_ids": [A, 30]},
                {"prompt_token_ids": [A], "stop_token_ids": [-1]},
                {"prompt_token_ids": [A], "n": 0},
                {"prompt_token_ids": [A], "routed_experts": True},
            )]
            return out, greedy, openai, errors

    out, greedy, openai, errors = asyncio.run(main())
    assert len(out["samples"]) == 5
    for sample in out["samples"]:
        n = len(sample["token_ids"])
        assert 1 <= n <= 20
        assert len(sample["logprobs"]) == n and len(sample["versions"]) == n
        assert sample["versions"] == [0] * n
        assert all(lp <= 0 for lp in sample["logprobs"])
        assert sample["finish_reason"] in ("stop", "length")
        assert all(0 <= t < 30 for t in sample["token_ids"])
    plp = out["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None and all(lp <= 0 for lp in plp[1:])
    # The same engine through vLLM's OpenAI layer: same greedy tokens, same logprobs.
    choice = openai["choices"][0]
    assert greedy["samples"][0]["token_ids"] == choice["token_ids"]
    assert greedy["samples"][0]["logprobs"] == pytest.approx(
        choice["logprobs"]["token_logprobs"], abs=1e-5)
    assert greedy["prompt_logprobs"] is None

    messages = [(status, body["error"]["message"]) for status, body in errors]
    assert [status for status, _ in messages] == [400] * 5
    assert messages[0][1] == f"max_tokens: prompt ({SEQ_LEN - 4} tokens) + max_tokens (16) exceeds seq_len {SEQ_LEN}"
    assert messages[1][1].startswith("prompt_token_ids:") and "[30]" in messages[1][1]
    assert messages[2][1].startswith("stop_token_ids:")
    assert "body.n" in messages[3][1]
    assert messages[4][1].startswith("routed_experts: this server does not record routing")


def test_sampling_controls_and_stop_strings_reach_the_engine(server):
    """top_k = 1 and min_p = 1 leave only the most likely token: sampling at T = 1 then gives
    the greedy tokens. A stop string ends the completion where the text completes it, and the ids
    are still every token sampled (the trainer trains on them)."""
    url = server["url"]
    prompt = [A, 4, 5, 6, EQ]

    async def main():
        async with aiohttp.ClientSession(connector=connector()) as s:
            greedy = await generate(s, url, "g", prompt_token_ids=prompt, max_tokens=8, temperature=0)
            top_k = await generate(s, url, "k", prompt_token_ids=prompt, n=4, max_tokens=8, top_k=1)
            min_p = await generate(s, url, "m", prompt_token_ids=prompt, n=4, max_tokens=8, min_p=1.0)
            stopped = await generate(s, url, "s", prompt_token_ids=[Z], max_tokens=20, temperature=0, stop=["zzz"])
            return greedy, top_k, min_p, stopped

    greedy, top_k, min_p, stopped = asyncio.run(main())
    want = greedy["samples"][0]["token_ids"]
    assert [x["token_ids"] for x in top_k["samples"]] == [want] * 4
    assert [x["token_ids"] for x in min_p["samples"]] == [want] * 4
    (sample,) = stopped["samples"]  # greedy on "z" writes "z" until max_tokens (LONG) unless stopped
    assert (sample["token_ids"], sample["finish_reason"]) == ([Z, Z, Z], "stop")
    assert len(sample["logprobs"]) == len(sample["versions"]) == 3


def test_abort_stops_the_engine_requests(server):
    url = server["url"]
    calls, n = 4, 64  # 256 engine requests, 128 at a time: ~6 s on one core

    async def main():
        async with aiohttp.ClientSession(connector=connector()) as s:
            start = time.perf_counter()
            full = await asyncio.gather(*(generate(s, url, f"full-{i}", n=n, **LONG)
                                          for i in range(calls)))
            unaborted_s = time.perf_counter() - start

            counted = (await health(s, url))["aborted"]
            start = time.perf_counter()
            tasks = [asyncio.create_task(generate(s, url, f"ab-{i}", n=n, **LONG))
                     for i in range(calls)]
            await wait_running(s, url, lambda c: c > 0)
            await asyncio.sleep(0.2)  # some tokens into the first wave
            duplicate = await post(s, f"{url}/generate", {"request_id": "ab-0", **LONG})
            aborted_at = time.perf_counter()
            ids = [f"ab-{i}" for i in range(calls)] + ["nope"]
            status, answer = await post(s, f"{url}/abort", {"request_ids": ids})
            assert status == 200, answer
            await wait_running(s, url, lambda c: c == 0)
            drained_s = time.perf_counter() - aborted_at
            out = await asyncio.gather(*tasks)
            returned_s = time.perf_counter() - aborted_at
            counted = (await health(s, url))["aborted"] - counted
            return (full, unaborted_s, aborted_at - start, drained_s, returned_s, out, answer,
                    duplicate, counted)

    (full, unaborted_s, abort_after_s, drained_s, returned_s, out, answer,
     duplicate, counted) = asyncio.run(main())
    print(f"\nunaborted {unaborted_s:.2f} s; aborted after {abort_after_s:.2f} s; engine idle "
          f"{drained_s:.3f} s and calls returned {returned_s:.3f} s after /abort")
    assert all(s["finish_reason"] == "length" and len(s["token_ids"]) == SEQ_LEN - 1
               for r in full for s in r["samples"])
    assert answer == {"aborted": calls}
    assert duplicate[0] == 409 and "ab-0" in duplicate[1]["error"]["message"]
    # The engine stopped, not just the HTTP calls: well before the work would have been done.
    assert abort_after_s + drained_s < unaborted_s / 2
    assert returned_s < unaborted_s / 2
    samples = [s for r in out for s in r["samples"]]
    assert len(samples) == calls * n
    assert all(s["finish_reason"] == "abort" for s in samples)
    assert all(len(s["token_ids"]) < SEQ_LEN - 1 for s in samples)
    assert all(len(s["token_ids"]) == len(s["logprobs"]) == len(s["versions"]) for s in samples)
    assert any(len(s["token_ids"]) > 0 for s in samples)
    # /health counts the engine requests /abort stopped while they ran: every sample that had
    # started (it has tokens) at least; one that /abort caught before it reached the engine never ran.
    assert sum(len(s["token_ids"]) > 0 for s in samples) <= counted <= calls * n


async def _update(s, url: str, path: str, version: int, mode: str) -> dict:
    status, answer = await post(s, f"{url}/update_weights",
                                {"path": path, "version": version, "mode": mode})
    assert status == 200, answer
    return answer


def test_in_flight_update_tags_every_token_with_the_version_that_sampled_it(server):
    url = server["url"]

    async def main():
        async with aiohttp.ClientSession(connector=connector()) as s:
            v = (await health(s, url))["version"]
            # "keep": at most MAX_NUM_SEQS requests, so all of them run when the update lands.
            task = await all_running(s, url, "keep")
            await asyncio.sleep(0.2)
            keep = await _update(s, url, server["zero"], v + 1, "keep")
            kept = await task
            after_keep = await generate(s, url, "after-keep", n=4, **LONG)

            # "wait": the zero weights write token 0; the running requests must finish on them.
            task = await all_running(s, url, "wait")
            update = asyncio.create_task(_update(s, url, server["model"], v + 2, "wait"))
            await asyncio.sleep(0.1)
            assert not update.done()
            # Arrives while the update drains: held until the new weights serve.
            during_wait = await generate(s, url, "during-wait", n=4, **LONG)
            wait, waited = await update, await task
            return v, keep, kept, after_keep, wait, waited, during_wait

    v, keep, kept, after_keep, wait, waited, during_wait = asyncio.run(main())
    print(f"\nkeep: {keep}\nwait: {wait}")
    assert keep["version"] == v + 1 and keep["switched"] == MAX_NUM_SEQS
    mixed = 0
    for sample in kept["samples"]:
        tokens, versions = sample["token_ids"], sample["versions"]
        assert len(tokens) == SEQ_LEN - 1 and sample["finish_reason"] == "length"
        assert versions == sorted(versions) and set(versions) <= {v, v + 1}
        # Exact: the old weights wrote "z", the zeroed ones write 0, token for token.
        assert versions == [v + 1 if t == 0 else v for t in tokens]
        assert set(tokens) <= {Z, 0}
        mixed += len(set(versions)) == 2
    assert mixed == MAX_NUM_SEQS
    for sample in after_keep["samples"]:
        assert sample["versions"] == [v + 1] * (SEQ_LEN - 1) and set(sample["token_ids"]) == {0}

    assert wait["version"] == v + 2
    for sample in waited["samples"]:
        assert len(sample["token_ids"]) == SEQ_LEN - 1
        assert set(sample["token_ids"]) == {0} and set(sample["versions"]) == {v + 1}
    for sample in during_wait["samples"]:
        assert sample["versions"] == [v + 2] * (SEQ_LEN - 1) and set(sample["token_ids"]) == {Z}


def test_a_pooled_connection_idle_past_the_servers_keep_alive_is_not_reused(server):
    """vLLM's HTTP server drops keep-alive connections idle for 5 s; a POST written to one it has
    dropped before the client noticed fails unsent. Seen as a failed /update_weights after a 0.5B
    model's 5 s blocking write on the event loop (benchmarks/weight_update.py); the same race
    exists whenever the loop is busy as the server closes. The client's pool keeps a connection
    3 s (rl.inference_api.KEEPALIVE_S): reused within that, replaced after, as aiohttp's own
    connection events show."""
    from rl.inference_api import InferenceClient, connector

    events: list[str] = []

    async def created(session, ctx, params):
        events.append("new")

    async def reused(session, ctx, params):
        events.append("reused")

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(created)
    trace.on_connection_reuseconn.append(reused)

    async def main():
        async with aiohttp.ClientSession(connector=connector(), trace_configs=[trace]) as s:
            client = InferenceClient(server["url"], s, None)
            answers = [await client.abort(["nobody"]), await client.abort(["nobody"])]
            time.sleep(6)  # the loop blocked past vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s)
            answers.append(await client.abort(["nobody"]))
            return answers

    answers = asyncio.run(main())
    assert answers == [{"aborted": 0}] * 3  # the server's own answer, every time
    assert events == ["new", "reused", "new"]


def test_health_reports_version_and_running_requests(server):
    url = server["url"]

    async def main():
        async with aiohttp.ClientSession(connector=connector()) as s:
            await _update(s, url, "base", 7, "wait")  # the model it started with, wherever it is
            busy = None
            for attempt in range(3):  # a starved poll can miss a whole run (see all_running)
                task = asyncio.create_task(generate(s, url, f"h-{attempt}", n=MAX_NUM_SEQS, **LONG))
                while busy is None and not task.done():
                    h = await health(s, url)
                    busy = h if h["running"] > 0 else None
                    await asyncio.sleep(0.005)
                await task
                if busy is not None:
                    return busy, await health(s, url)
            return None, await health(s, url)

    busy, idle = asyncio.run(main())
    assert busy is not None and busy["running"] == MAX_NUM_SEQS and busy["version"] == 7
    # The instance is the one its heartbeat announces (the orchestrator's identity check).
    announced = server_heartbeat_path(server["root"], url).read_text().splitlines()[0]
    assert idle == {"status": "ok", "version": 7, "path": str(TINY_MODEL.resolve()), "running": 0,
                    "aborted": busy["aborted"], "instance": announced}  # nothing aborted: the run ended by itself


def test_a_multi_turn_episode_on_real_vllm(server):
    """Guess-the-letter through the orchestrator's rollout code against the real engine, checked
    on every episode and turn: the trained ids of each model turn are exactly the ids the engine
    returned, each turn's request is exactly the episode so far, and only the model's tokens are
    trained on."""
    from orchestrator.prompts.queue import Prompt
    from orchestrator.rollout.groups import Rollouts
    from tasks.guess_letter import GuessLetter
    from orchestrator.rendering.tokenizer import load_tokenizer
    from rl.config import RunConfig
    from rl.inference_api import InferenceClient

    url = server["url"]
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "seq_len": SEQ_LEN, "orchestrator": {
        "environment": {"class": "tasks.guess_letter:GuessLetter", "max_turns": 4}, "sampling": {"max_tokens": 3},
        "scheduling": {"group_size": 4}}})
    seen = {}

    async def scenario():
        async with aiohttp.ClientSession(connector=connector()) as session:
            client = InferenceClient(url, session)

            async def generate(request):
                response = await client.generate(request, 60)
                seen[request.request_id] = (list(request.prompt_token_ids), response.samples[0].token_ids)
                return response

            rollouts = Rollouts(cfg, load_tokenizer(str(TINY_MODEL)), {}, None, GuessLetter())
            return await rollouts.group(Prompt(0, {"secret": "z"}), "episode-test", generate)

    group = asyncio.run(scenario())
    assert group.failed == 0 and len(group.samples) == 4
    for e, s in enumerate(group.samples):
        turns = [seen[k] for k in sorted(k for k in seen if k.startswith(f"episode-test-e{e}-t"))]
        starts = [i for i, m in enumerate(s.loss_mask) if m and (i == 0 or not s.loss_mask[i - 1])]
        ends = [i + 1 for i, m in enumerate(s.loss_mask) if m and (i + 1 == len(s.loss_mask) or not s.loss_mask[i + 1])]
        assert len(turns) >= 1 and s.loss_mask[0] == 0
        assert [s.tokens[a:b] for a, b in zip(starts, ends)] == [ids for _, ids in turns]
        assert [s.tokens[:a] for a in starts] == [prompt for prompt, _ in turns]
        assert all(v >= 0 for v, m in zip(s.versions, s.loss_mask) if m)
