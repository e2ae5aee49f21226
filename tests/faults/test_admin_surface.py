"""The inference server's admin surface: a bearer token on every route but the probes (ours and
vLLM's, from inference.api_token or ASYNCRL_API_TOKEN), no start off loopback without one, the
token never written or printed, weight paths confined, bad bodies refused with one line naming
the field. One real vLLM server for every check that needs one."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess

import aiohttp
import httpx
import pytest
from conftest import TINY_MODEL, rl_command
from programs import start_server

from rl.config import RunConfig
from rl.inference_api import TOKEN_ENV, InferenceClient, InferenceError, connector
from rl.rundir import RunDir

slow = pytest.mark.slow

TOKEN = "s3cret-token"
A, EQ = 3, 29  # "a" and "=" in the char tokenizer
RIGHT = {"Authorization": f"Bearer {TOKEN}"}
WRONG = {
    "none": {},
    "wrong token": {"Authorization": "Bearer not-it"},
    "no scheme": {"Authorization": TOKEN},
    "other scheme": {"Authorization": f"Basic {TOKEN}"},
    # Not ASCII: must be a 401, not a 500 from comparing it.
    "latin-1": {"Authorization": b"Bearer s3cret-tok\xe9n"},
}
# (method, route, body) for routes that need the token: ours, then vLLM's, including those
# its own --api-key leaves open.
GUARDED = [
    ("POST", "/update_weights", {"path": "x", "version": 1}),
    ("POST", "/generate", {"request_id": "r", "prompt_token_ids": [A]}),
    ("POST", "/abort", {"request_ids": ["r"]}),
    ("POST", "/load_lora_adapter", {"name": "a", "path": "x", "version": 1}),
    ("POST", "/unload_lora_adapter", {"name": "a"}),
    ("POST", "/init_broadcaster", {"address": "x:1", "rank_offset": 1, "world_size": 2}),
    ("GET", "/broadcaster", None),
    ("POST", "/v1/completions", {"model": str(TINY_MODEL), "prompt": [A], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/invocations", {"model": str(TINY_MODEL), "prompt": [A], "max_tokens": 2}),
    ("POST", "/scale_elastic_ep", {"new_data_parallel_size": 2}),
    ("POST", "/tokenize", {"model": str(TINY_MODEL), "prompt": "a"}),
]
REFUSAL = "rl inference: inference.host 0.0.0.0 exposes the admin routes: set inference.api_token or ASYNCRL_API_TOKEN"


@pytest.fixture
def no_env_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


# --- without a server ------------------------------------------------------------------------


@pytest.mark.parametrize("host, token, refused", [
    ("127.0.0.1", None, False), ("127.3.2.1", None, False), ("::1", None, False),
    ("localhost", None, False), ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True),
    ("myhost", None, True), ("", None, True), ("0.0.0.0", TOKEN, False),
])
def test_exposure_needs_a_token_off_loopback(host, token, refused):
    from inference.preflight import exposure_error

    error = exposure_error(host, token)
    assert (error is not None) == refused
    if refused:
        assert error.startswith(f"inference.host {host} exposes the admin routes")


def imported_modules(stderr: str) -> set[str]:
    """Top-level packages a process (and its children) imported, from PYTHONPROFILEIMPORTTIME's
    lines ("import time: self | cumulative | module")."""
    return {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_non_loopback_host_without_token_exits_2_before_vllm(tmp_path, no_env_token):
    """Refused before any engine could start: vLLM is never even imported (every process the
    command starts reports its imports), and nothing is written."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\n[inference]\nhost = "0.0.0.0"\n')
    proc = subprocess.run(rl_command("inference", "@", str(cfg)), capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2, said
    assert said[-1] == REFUSAL
    assert "vllm" not in "\n".join(said).lower()
    imported = imported_modules(proc.stderr)
    assert "rl" in imported and "vllm" not in imported, sorted(imported)
    assert not (tmp_path / "run").exists()


def test_the_token_is_never_saved_or_printed(tmp_path, no_env_token):
    from rl.resolved_config import save_resolved

    toml = tmp_path / "cfg.toml"
    toml.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\n[inference]\napi_token = "{TOKEN}"\n')
    dry = subprocess.run(rl_command("inference", "@", str(toml), "--dry-run"), capture_output=True, text=True,
                         timeout=60, check=False)
    assert dry.returncode == 0, dry.stderr
    assert 'api_token = "<redacted>"' in dry.stdout
    assert TOKEN not in dry.stdout + dry.stderr

    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(tmp_path / "run"),
                                    "inference": {"api_token": TOKEN}})
    save_resolved(cfg, "inference")
    saved = RunDir(tmp_path / "run").config_file("inference").read_text()
    assert "api_token =" not in saved and TOKEN not in saved  # composed again, it takes the env token
    assert cfg.inference.api_token == TOKEN  # redacted in the text only


def test_clients_take_the_token_from_config_else_the_environment(monkeypatch):
    from inference.server import vllm_args

    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert InferenceClient("http://x", None).headers == {"Authorization": "Bearer from-env"}
    assert InferenceClient("http://x", None, "from-cfg").headers == {"Authorization": "Bearer from-cfg"}
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL)})
    flags = vllm_args(cfg)
    assert flags[flags.index("--api-key") + 1] == "from-env"
    monkeypatch.delenv(TOKEN_ENV)
    assert InferenceClient("http://x", None).headers == {}
    assert "--api-key" not in vllm_args(cfg)


# --- one real server, its token from the environment -------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin")
    run = RunDir(tmp / "run")
    # Inside the roots, loadable: proves the token is all that the 401s lacked.
    shutil.copytree(TINY_MODEL, run.weights_dir(1))
    # Outside the roots, but loadable too: only confinement refuses them.
    outside = tmp / "outside"
    shutil.copytree(TINY_MODEL, outside)
    (outside / "adapter_config.json").write_text("{}")
    (outside / "adapter_model.safetensors").write_bytes(b"")
    (run.weights / "link").symlink_to(outside)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TOKEN_ENV, TOKEN)
        proc, url = start_server(tmp, "server", TINY_MODEL, run.root, "max_loras = 1\n[trainer.lora]\nrank = 8\n")
    try:
        yield {"url": url, "run": run, "outside": outside}
    finally:
        proc.stop()


def call(url: str, method: str, route: str, body=None, headers=None, content=None) -> httpx.Response:
    return httpx.request(method, f"{url}{route}", json=body, content=content, headers=headers or {}, timeout=60)


@slow
def test_every_route_but_the_probes_needs_the_token(server):
    url = server["url"]
    for method, route, body in GUARDED:
        for why, headers in WRONG.items():
            r = call(url, method, route, body, headers)
            assert r.status_code == 401, (route, why, r.text)
            assert r.json()["error"]["message"] == ("missing or wrong bearer token "
                                                    "(inference.api_token or ASYNCRL_API_TOKEN)")
    # Refused before the body is read: no schema errors for strangers.
    assert call(url, "POST", "/generate", content=b"{", headers={"Content-Type": "application/json"}).status_code == 401
    for route in ("/health", "/metrics", "/ping", "/version"):
        assert call(url, "GET", route).status_code == 200, route


@slow
def test_the_right_token_works(server):
    url = server["url"]
    r = call(url, "POST", "/generate", {"request_id": "g", "prompt_token_ids": [A, EQ], "max_tokens": 4}, RIGHT)
    assert r.status_code == 200 and len(r.json()["samples"][0]["token_ids"]) >= 1, r.text
    r = call(url, "POST", "/v1/completions", {"model": str(TINY_MODEL), "prompt": [A, EQ], "max_tokens": 4}, RIGHT)
    assert r.status_code == 200, r.text
    path = str(server["run"].weights_dir(1))
    r = call(url, "POST", "/update_weights", {"path": path, "version": 1}, RIGHT)
    assert r.status_code == 200 and r.json()["version"] == 1, r.text

    async def through_the_client():
        async with aiohttp.ClientSession(connector=connector()) as session:
            # The orchestrator passes cfg.inference.api_token: None here, so the environment's.
            os.environ[TOKEN_ENV] = TOKEN
            try:
                assert (await InferenceClient(url, session).broadcaster())["group"] is None
            finally:
                del os.environ[TOKEN_ENV]
            with pytest.raises(InferenceError, match="HTTP 401"):
                await InferenceClient(url, session, "not-it").broadcaster()

    asyncio.run(through_the_client())


@slow
def test_weight_paths_outside_the_roots_are_refused(server):
    url, run, outside = server["url"], server["run"], server["outside"]
    escapes = {
        "outside": str(outside),
        "symlink inside to outside": str(run.weights / "link"),
        "../": f"{run.weights}/../../outside",
        "../ from the model": f"{TINY_MODEL}{'/..' * len(TINY_MODEL.parts)}{outside}",
        # Relative paths are read from the server's output_dir (hosts mount it where they like).
        "relative ../": "../outside",
        "relative through the symlink": "weights/link",
    }
    for route, body in (("/update_weights", {"version": 2}), ("/load_lora_adapter", {"name": "a", "version": 2})):
        for why, path in escapes.items():
            r = call(url, "POST", route, {**body, "path": path}, RIGHT)
            assert r.status_code == 403, (route, why, r.text)
            assert r.json()["error"]["message"].startswith("path: "), (route, why, r.text)


BAD_BODIES = [
    # (route, raw JSON text, the field the message starts with, and what it says)
    ("/generate", '{"request_id": "b", "prompt_token_ids": [3', "body", "not valid JSON"),
    ("/generate", '[]', "body", "valid dictionary"),
    ("/generate", '{"request_id": "b"}', "body.prompt_token_ids", "Field required"),
    ("/generate", '{"request_id": "b", "prompt_token_ids": [3], "temprature": 0}', "body.temprature",
     "Extra inputs are not permitted"),
    ("/generate", '{"request_id": "b", "prompt_token_ids": [3], "n": "many"}', "body.n", "valid integer"),
    ("/generate", '{"request_id": "b", "prompt_token_ids": [3], "max_tokens": 0}', "body.max_tokens", "greater than"),
    ("/generate", '{"request_id": "b", "prompt_token_ids": ["a"]}', "body.prompt_token_ids.0", "valid integer"),
    ("/generate", '{"request_id": "b", "prompt_token_ids": [3], "temperature": NaN}', "body.temperature",
     "finite number"),
    ("/update_weights", '{"path": "x"}', "body.version", "Field required"),
    ("/update_weights", '{"path": "x", "version": -1}', "body.version", "greater than"),
    ("/update_weights", '{"path": "x", "version": 1, "mode": "now"}', "body.mode", "'wait' or 'keep'"),
    ("/update_weights", '{"path": 7, "version": 1}', "body.path", "valid string"),
    ("/update_weights", '{"path": "x", "version": 1, "force": true}', "body.force", "Extra inputs"),
    ("/abort", '{"request_ids": "r"}', "body.request_ids", "valid list"),
    ("/abort", '{}', "body.request_ids", "Field required"),
    ("/load_lora_adapter", '{"name": "a/b", "path": "x", "version": 1}', "body.name", "pattern"),
    ("/load_lora_adapter", '{"name": "a", "version": 1}', "body.path", "Field required"),
]


@slow
def test_bad_bodies_get_one_line_naming_the_field(server):
    headers = {**RIGHT, "Content-Type": "application/json"}
    for route, text, field, says in BAD_BODIES:
        r = call(server["url"], "POST", route, content=text.encode(), headers=headers)
        assert r.status_code == 400, (route, text, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(f"{field}: ") and says in message and "\n" not in message, (route, text, message)
    r = call(server["url"], "POST", "/generate", {"request_id": "b", "prompt_token_ids": [3], "n": 0, "top_p": 2},
             RIGHT)
    assert r.json()["error"]["message"] == ("body.n: Input should be greater than or equal to 1 (got 0); "
                                            "body.top_p: Input should be less than or equal to 1 (got 2)")
    # vLLM's own routes keep their own validation.
    r = call(server["url"], "POST", "/v1/completions", {"model": str(TINY_MODEL), "prompt": [A], "max_tokens": "x"},
             RIGHT)
    assert r.status_code == 400 and "max_tokens" in r.text
