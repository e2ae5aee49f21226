"""Config: composition, overrides, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import typing

import pytest
import tomli_w
from pydantic import BaseModel

from conftest import TINY_MODEL, free_port, rl_command
from rl.config import ConfigError, load_config
from rl.config.moved import GONE, MOVED
from rl.config.orchestrator_tables import SchedulingConfig


def run_rl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(rl_command(*args), capture_output=True, text=True, timeout=60)


def test_files_compose_left_to_right_and_flags_win(write_toml):
    a = write_toml('model = "m"\nmax_steps = 5\n[trainer.optim]\nlr = 1e-4\n', "a.toml")
    b = write_toml("max_steps = 7\n[orchestrator.scheduling]\ngroup_size = 4\n", "b.toml")
    cfg, dry = load_config(["@", str(a), f"@{b}", "--trainer.optim.lr", "2e-5", "--seed=3"])
    assert (cfg.max_steps, cfg.orchestrator.scheduling.group_size, cfg.trainer.optim.lr, cfg.seed) == (7, 4, 2e-5, 3)
    assert cfg.trainer.optim.betas == (0.9, 0.99)  # untouched defaults survive the merge
    assert not dry


def test_off_policy_steps_default_to_async_level(write_toml):
    cfg, _ = load_config(["@", str(write_toml('model = "m"\nmax_async_level = 3\n'))])
    assert cfg.off_policy_steps == 3


@pytest.mark.parametrize("args, message", [
    (["--trainer.optim.lrr", "1"], "unknown config key: trainer.optim.lrr"),
    (["--max_steps", "many"], "config key max_steps"),
    (["--orchestrator.scheduling.max_off_policy_steps", "0", "--max_async_level", "2"], "must be >= max_async_level"),
    (["--orchestrator.scheduling.max_in_flight_groups", "2"], "orchestrator.scheduling.max_in_flight_groups"),
    (["--orchestrator.environment.class", "m:E", "--orchestrator.datasets", '[{path = "d.jsonl"}]'],
     "orchestrator.datasets is unused when orchestrator.environment.class is set"),
    (["--orchestrator.environment.class", "not-a-spec"], "config key orchestrator.environment.class: expected"),
    (["--orchestrator.environment.class_", "m:E"], "unknown config key: orchestrator.environment.class_"),
    (["--orchestrator.environment.max_turns", "0"], "config key orchestrator.environment.max_turns"),
    (["--orchestrator.datasets", '[{function = "m:f"}]'], "dataset m: no reward and no orchestrator.teacher.url"),
    (["--transport.kind", "pigeon"], "config key transport.kind"),
    (["--trainer.batching.micro_batch_tokens", "100", "--seq_len", "256"], "trainer.batching.micro_batch_tokens (100) must be >= seq_len"),
    (["--trainer.loss.mask_low", "2", "--trainer.loss.mask_high", "1"], "trainer.loss.mask_low (2.0) must be below"),
    (["--trainer.loss.normalization", "batch"], "config key trainer.loss.normalization"),
    (["--trainer.lora.multi_run", "true"], "need LoRA: set trainer.lora.rank > 0"),
    (["--run_name", "../x", "--trainer.lora.rank", "8"], "config key run_name"),
    (["--run_name", "a", "--trainer.lora.rank", "8", "--transport.kind", "zmq"], 'needs transport.kind = "files"'),
    (["--trainer.lora.rank", "8", "--weight_sync.kind", "broadcast"], 'weight_sync.kind must be "files"'),
    (["--inference.cpus", "[-1]"], "config key inference.cpus.0"),
    (["--trainer.profile_steps", "[3]"], "trainer.profile_steps: expected [first, last]"),
    (["--trainer.profile_steps", "[4, 2]"], "trainer.profile_steps: expected [first, last]"),
    (["--trainer.profile_steps", "[0, 2]"], "trainer.profile_steps: expected [first, last]"),
])
def test_bad_values_raise_one_line_naming_the_key(write_toml, args, message):
    with pytest.raises(ConfigError) as err:
        load_config(["@", str(write_toml('model = "m"\n')), *args])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


# A value each moved key accepts, to load it at its new place (3 where that will do).
MOVED_VALUES = {"server_urls": ["http://h:1"], "discover_servers": False, "teacher_url": "http://h:1",
                "tool_parser": "m:Parser", "chat": "off", "chat_template": "t.jinja", "chat_template_kwargs": {},
                "system_prompt": "s", "top_p": 0.5, "min_p": 0.5, "stop": ["x"], "record_kept_sets": True,
                "normalize_advantages": True, "filter_zero_variance": True, "in_flight_updates": False,
                "max_in_flight_groups": 20, "environment_args": {}, "environment": "m:Env",
                "dtype": "float32", "attention": "sdpa", "compile": True, "activation_checkpointing": True,
                "reference_offload": True, "pack": False, "micro_batch_tokens": 8192, "sampling_mask": False,
                "routing_replay": False, "heartbeat_timeout_s": 30}

# The keys that moved, written out here rather than read from MOVED: a key dropped from MOVED (or
# sent somewhere else) fails its case instead of silently leaving the test. `[]`: in each entry.
_ORCHESTRATOR_KEYS = {
    "server_urls": "servers.urls", "discover_servers": "servers.discover", "server_retry_max_s": "servers.retry_max_s",
    "teacher_url": "teacher.url", "teacher_coef": "teacher.coef", "tool_parser": "tools.parser",
    "overlong_buffer": "overlong.buffer", "overlong_penalty": "overlong.penalty",
    "chat": "prompts.chat", "chat_template": "prompts.chat_template",
    "chat_template_kwargs": "prompts.chat_template_kwargs", "system_prompt": "prompts.system_prompt",
    "max_tokens": "sampling.max_tokens", "temperature": "sampling.temperature", "top_p": "sampling.top_p",
    "top_k": "sampling.top_k", "min_p": "sampling.min_p", "stop": "sampling.stop",
    "record_kept_sets": "sampling.record_kept_sets",
    "prompts_per_step": "scheduling.prompts_per_step", "group_size": "scheduling.group_size",
    "min_group_episodes": "scheduling.min_group_episodes",
    "normalize_advantages": "scheduling.normalize_advantages",
    "filter_zero_variance": "scheduling.filter_zero_variance",
    "max_in_flight_groups": "scheduling.max_in_flight_groups",
    "max_off_policy_steps": "scheduling.max_off_policy_steps", "in_flight_updates": "scheduling.in_flight_updates",
    "poll_interval_s": "scheduling.poll_interval_s", "max_futile_streak": "scheduling.max_futile_streak",
    "reward_timeout_s": "timeouts.reward_s", "trainer_timeout_s": "timeouts.weights_s",
    "request_timeout_s": "timeouts.request_s", "servers.request_timeout_s": "timeouts.request_s",
    "server_wait_timeout_s": "timeouts.server_wait_s", "servers.wait_timeout_s": "timeouts.server_wait_s",
    "tool_timeout_s": "timeouts.tool_s", "tools.timeout_s": "timeouts.tool_s",
    "environment_args": "environment.args", "max_turns": "environment.max_turns",
    "timeouts.trainer_s": "timeouts.weights_s", "eval.timeout_s": "timeouts.eval_s",
}
OLD_KEYS = {
    **{f"orchestrator.{old}": f"orchestrator.{new}" for old, new in _ORCHESTRATOR_KEYS.items()},
    "orchestrator.keep_checkpoints": "checkpoints.keep", "orchestrator.checkpoints.keep": "checkpoints.keep",
    "trainer.dtype": "trainer.model.dtype", "trainer.attention": "trainer.model.attention",
    "trainer.compile": "trainer.model.compile", "trainer.activation_checkpointing": "trainer.model.activation_checkpointing",
    "trainer.reference_offload": "trainer.model.reference_offload",
    "trainer.logits_chunk_tokens": "trainer.model.logits_chunk_tokens",
    "trainer.pack": "trainer.batching.pack", "trainer.micro_batch_tokens": "trainer.batching.micro_batch_tokens",
    "trainer.micro_batch_size": "trainer.batching.micro_batch_size",
    "trainer.sampling_mask": "trainer.mismatch.sampling_mask", "trainer.routing_replay": "trainer.mismatch.routing_replay",
    "trainer.mismatch_kl_warn": "trainer.mismatch.kl_warn",
    "trainer.weights_shard_mb": "trainer.files.weights_shard_mb", "trainer.keep_weights": "trainer.files.keep_weights",
    "trainer.keep_rollouts": "trainer.files.keep_rollouts",
    "trainer.batch_timeout_s": "trainer.timeouts.batch_s", "trainer.lora.run_timeout_s": "trainer.timeouts.run_s",
    "trainer.checkpoint_every": "checkpoints.every", "trainer.keep_checkpoints": "checkpoints.keep",
    "heartbeat_timeout_s": "timeouts.heartbeat_s", "weight_sync.timeout_s": "timeouts.broadcast_s",
    "inference.reload_timeout_s": "inference.timeouts.reload_s",
    **{f"{entries}[].{key}": f"{entries}[].{table}.{key}"
       for entries in ("orchestrator.datasets", "orchestrator.eval.datasets", "sft.datasets", "sft.eval_datasets")
       for table, key in [("sampling", k) for k in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop")]
       + [("prompts", "system_prompt")]},
    "orchestrator.eval.environments[].environment": "orchestrator.eval.environments[].class",
    "orchestrator.eval.environments[].environment_args": "orchestrator.eval.environments[].args",
}
# What each list's entry needs besides the key under test to load.
ENTRY = {"orchestrator.eval.environments": {"name": "e", "class": "m:Env"}}


def nested(path: str, value) -> dict:
    """{"a": {"b": [{...entry, "c": value}]}} for "a.b[].c"."""
    if "[]" in path:
        entries, rest = path.split("[]")
        entry = {"function": "m:f", "reward": "m:r"} if entries not in ENTRY else dict(ENTRY[entries])
        if rest.strip(".") in ("environment", "class"):
            entry.pop("class", None)
        _merge_into(entry, nested(rest.strip("."), value))
        return nested(entries, [entry])
    out: dict = {}
    node = out
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def _merge_into(a: dict, b: dict) -> None:
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            _merge_into(a[k], v)
        else:
            a[k] = v


def _at(cfg, path: str):
    value = cfg
    for part in path.replace("[]", ".0").split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, "class_" if part == "class" else part)
    return value


def test_every_moved_key_is_listed_here():
    """A key MOVED gains gets a case here too (OLD_KEYS is the test's own list)."""
    assert set(MOVED) <= set(OLD_KEYS), sorted(set(MOVED) - set(OLD_KEYS))


@pytest.mark.parametrize("old, new", OLD_KEYS.items())
def test_a_moved_key_is_refused_naming_its_new_place(write_toml, old, new):
    """A config written before its table was regrouped ([orchestrator]'s tables, issue 53; [trainer]
    grouped by concern, one [checkpoints], timeouts in `timeouts` tables, a dataset's own sampling
    and prompts as sub-tables, issue 61): one line saying where the key lives now, in the TOML file
    and, for a plain key, as a flag; the new place loads."""
    value = MOVED_VALUES.get(old.rpartition(".")[2], 3)
    old_toml = tomli_w.dumps(_with_model(nested(old, value)))
    argvs = [["@", str(write_toml(old_toml))]]
    if "[]" not in old:
        argvs.append(["@", str(write_toml('model = "m"\n', "bare.toml")), f"--{old}", json.dumps(value)])
    for argv in argvs:
        with pytest.raises(ConfigError) as err:
            load_config(argv)
        if "[]" in old:
            entries, inner = new.split("[]")
            table, _, key = inner.strip(".").rpartition(".")
            where = f"`{key} = ...` " + (f"under `{table}` " if table else "") + f"in each [[{entries}]] entry"
            assert str(err.value) == f"{old.replace('[]', '[0]')} is now {new.replace('[]', '[0]')}: write it as {where}"
        else:
            table, _, key = new.rpartition(".")
            assert str(err.value) == f"{old} is now {new}: write it as `{key} = ...` under [{table}] (or --{new})"
    cfg, _ = load_config(["@", str(write_toml(tomli_w.dumps(_with_model(nested(new, value))), "new.toml"))])
    loaded = _at(cfg, new)
    assert (str(loaded) if new.endswith("chat_template") else loaded) == value


def _with_model(data: dict) -> dict:
    return {"model": "m", **data}


@pytest.mark.parametrize("key", ["orchestrator.dataset", "orchestrator.reward"])
def test_the_orchestrators_own_dataset_and_reward_are_refused_for_the_datasets_list(write_toml, key):
    """One way to name what is rolled out: [[orchestrator.datasets]], each with its reward."""
    with pytest.raises(ConfigError) as err:
        load_config(["@", str(write_toml(f'model = "m"\n[orchestrator]\n{key.split(".")[1]} = "m:f"\n'))])
    assert str(err.value) == GONE[key] and "[[orchestrator.datasets]]" in str(err.value)


@pytest.mark.parametrize("table", ["transport", "weight_sync"])
def test_the_filesystem_kind_is_refused_for_files(write_toml, table):
    with pytest.raises(ConfigError) as err:
        load_config(["@", str(write_toml(f'model = "m"\n[{table}]\nkind = "filesystem"\n'))])
    assert str(err.value) == f'{table}.kind = "filesystem" is now "files": write {table}.kind = "files"'
    cfg, _ = load_config(["@", str(write_toml(f'model = "m"\n[{table}]\nkind = "files"\n', "new.toml"))])
    assert getattr(cfg, table).kind == "files" and cfg.weight_delivery == "files"


@pytest.mark.parametrize("table, key, value, kind", [
    ("transport", "address", '"tcp://h:1"', "zmq"), ("transport", "bind", '"tcp://*:1"', "zmq"),
    ("weight_sync", "address", '"h:1"', "broadcast"), ("weight_sync", "bucket_mb", "64", "broadcast"),
])
def test_a_kind_specific_key_is_refused_under_another_kind(write_toml, table, key, value, kind):
    """transport.address, weight_sync.bucket_mb, ... exist only in their kind's table (a
    discriminated union): set without that kind, one line names the kind they need."""
    with pytest.raises(ConfigError) as err:
        load_config(["@", str(write_toml(f'model = "m"\n[{table}]\n{key} = {value}\n'))])
    assert str(err.value) == (f'{table}.{key} applies to {table}.kind = "{kind}" only (this config\'s kind: '
                              f'"files"): set {table}.kind = "{kind}", or remove {table}.{key}')
    cfg, _ = load_config(["@", str(write_toml(f'model = "m"\n[{table}]\nkind = "{kind}"\n{key} = {value}\n', "k.toml"))])
    assert getattr(getattr(cfg, table), key) == json.loads(value.replace("'", '"'))


# One old form of each kind, refused by the real command line before anything starts.
CLI_SAMPLES = [
    ("trainer", "[trainer]\nkeep_checkpoints = 3\n", "trainer.keep_checkpoints is now checkpoints.keep"),
    ("trainer", "[trainer]\nbatch_timeout_s = 60\n", "trainer.batch_timeout_s is now trainer.timeouts.batch_s"),
    ("orchestrator", "[orchestrator.checkpoints]\nkeep = 3\n", "orchestrator.checkpoints.keep is now checkpoints.keep"),
    ("orchestrator", '[orchestrator]\ndataset = "m:f"\n', GONE["orchestrator.dataset"]),
    ("orchestrator", '[[orchestrator.datasets]]\nfunction = "m:f"\ntemperature = 0.5\n',
     "orchestrator.datasets[0].temperature is now orchestrator.datasets[0].sampling.temperature"),
    ("orchestrator", '[[orchestrator.datasets]]\nfunction = "m:f"\nsystem_prompt = "s"\n',
     "orchestrator.datasets[0].system_prompt is now orchestrator.datasets[0].prompts.system_prompt"),
    ("inference", '[weight_sync]\nkind = "filesystem"\n', 'weight_sync.kind = "filesystem" is now "files"'),
    ("inference", "[inference]\nreload_timeout_s = 5\n", "inference.reload_timeout_s is now inference.timeouts.reload_s"),
    ("run", "heartbeat_timeout_s = 30\n", "heartbeat_timeout_s is now timeouts.heartbeat_s"),
    ("run", "[orchestrator.timeouts]\ntrainer_s = 30\n", "orchestrator.timeouts.trainer_s is now orchestrator.timeouts.weights_s"),
    ("trainer", "[transport]\naddress = \"tcp://h:1\"\n", 'transport.address applies to transport.kind = "zmq" only'),
]


@pytest.mark.parametrize("program, text, line", CLI_SAMPLES)
def test_the_command_line_refuses_an_old_form_with_exit_2_and_one_line(write_toml, program, text, line):
    result = run_rl(program, "@", str(write_toml(f'model = "m"\n{text}')), "--dry-run")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rl {program}: {line}"), result.stderr


def test_overlong_as_a_string_is_refused_naming_its_table(write_toml):
    with pytest.raises(ConfigError, match=r'^orchestrator.overlong is a table now: write `mode = "mask"` under '
                                          r"\[orchestrator.overlong\] \(or --orchestrator.overlong.mode\)$"):
        load_config(["@", str(write_toml('model = "m"\n[orchestrator]\noverlong = "mask"\n'))])
    cfg, _ = load_config(["@", str(write_toml('model = "m"\n')), "--orchestrator.overlong.mode", "mask"])
    assert cfg.orchestrator.overlong.mode == "mask"


ENVIRONMENT_HINT = ('orchestrator.environment is a table now: write `class = "tasks.guess_letter:GuessLetter"` under '
                    "[orchestrator.environment] (or --orchestrator.environment.class)")


@pytest.mark.parametrize("argv", [
    ['--orchestrator.environment=tasks.guess_letter:GuessLetter'],
    ["--orchestrator.environment", "tasks.guess_letter:GuessLetter"],
    # A table in the file, the old flag after it: still refused, not silently a string.
    ["@", "TABLE", "--orchestrator.environment", "tasks.guess_letter:GuessLetter"],
    ["@", "OLD"],
    ["@", "OLD", "--orchestrator.environment.max_turns", "3"],  # the string in the file, a key of the table after it
])
def test_environment_as_a_string_is_refused_naming_its_table(write_toml, argv):
    """orchestrator.environment was `module:Class` (with environment_args and max_turns beside it,
    moved through MOVED); it is the [orchestrator.environment] table now, its class under `class`."""
    files = {"TABLE": write_toml('[orchestrator.environment]\nmax_turns = 3\n', "table.toml"),
             "OLD": write_toml('[orchestrator]\nenvironment = "tasks.guess_letter:GuessLetter"\n', "old.toml")}
    argv = [str(files.get(a, a)) for a in argv]
    with pytest.raises(ConfigError) as err:
        load_config(["@", str(write_toml('model = "m"\n')), *argv])
    assert str(err.value) == ENVIRONMENT_HINT


def test_cli_refuses_environment_as_a_string_with_exit_2(write_toml):
    result = run_rl("orchestrator", "@", str(write_toml('model = "m"\n')),
                    "--orchestrator.environment=tasks.guess_letter:GuessLetter")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"rl orchestrator: {ENVIRONMENT_HINT}"], result.stderr


def test_environment_table_loads_under_class_and_saves_back_the_same(write_toml):
    """`class` is a Python keyword: the field is class_ with the alias `class`, its only name in
    TOML, flags, the saved config and --help."""
    from rl.resolved_config import render_toml

    text = ('model = "m"\n[orchestrator.environment]\nclass = "tasks.guess_letter:GuessLetter"\n'
            'args = {id = "x"}\nmax_turns = 4\n')
    cfg, _ = load_config(["@", str(write_toml(text))])
    env = cfg.orchestrator.environment
    assert (env.class_, env.args, env.max_turns) == ("tasks.guess_letter:GuessLetter", {"id": "x"}, 4)
    flags, _ = load_config(["@", str(write_toml('model = "m"\n', "bare.toml")),
                            "--orchestrator.environment.class", "tasks.guess_letter:GuessLetter",
                            "--orchestrator.environment.args", '{id = "x"}',
                            "--orchestrator.environment.max_turns", "4"])
    assert flags == cfg
    saved = render_toml(cfg, omit_secrets=True)
    assert 'class = "tasks.guess_letter:GuessLetter"' in saved and "class_" not in saved
    again, _ = load_config(["@", str(write_toml(saved, "saved.toml"))])
    assert again == cfg
    assert "--orchestrator.environment.class TEXT" in run_rl("orchestrator", "--help").stdout


def test_an_eval_environment_takes_the_run_max_turns_unless_it_sets_its_own(write_toml):
    text = ('model = "m"\n[orchestrator.environment]\nmax_turns = 5\n'
            '[[orchestrator.eval.environments]]\nname = "a"\nclass = "tasks.calculator:Calculator"\nargs = {k = 1}\n'
            '[[orchestrator.eval.environments]]\nname = "b"\nclass = "tasks.calculator:Calculator"\nmax_turns = 2\n')
    cfg, _ = load_config(["@", str(write_toml(text))])
    o = cfg.orchestrator
    a, b = (o.for_eval_environment(spec).environment for spec in o.eval.environments)
    assert (a.class_, a.args, a.max_turns) == ("tasks.calculator:Calculator", {"k": 1}, 5)
    assert (b.class_, b.args, b.max_turns) == ("tasks.calculator:Calculator", {}, 2)
    assert o.environment.class_ == ""  # the run itself still trains on its datasets


@pytest.mark.parametrize("text, args, message", [
    ('model = "m"\nbogus = 1\n', [], "unknown config key: bogus"),
    ('model = "m"\n[trainer.batching]\nmicro_batch_size = "x"\n', [], "trainer.batching.micro_batch_size"),
    ("max_steps = 3\n", [], "missing config key: model"),
    ("model = \n", [], "invalid TOML"),
    ('model = "m"\n', ["@", "no/such/file.toml"], "config file not found: no/such/file.toml"),
    ('model = "m"\n[trainer]\ncpus = [4096]\n', [], "trainer.cpus = [4096]: core(s) [4096] are not available"),
])
def test_cli_errors_exit_2_with_one_line(write_toml, text, args, message):
    result = run_rl("trainer", "@", str(write_toml(text)), *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_dry_run_prints_resolved_config_with_docs(write_toml, tmp_path):
    cfg = write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\n')
    result = run_rl("orchestrator", "@", str(cfg), "--orchestrator.scheduling.group_size", "5", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "run").exists()  # checked, not created
    assert "group_size = 5" in result.stdout
    assert "# Completions per prompt" in result.stdout
    assert "[trainer.optim]" in result.stdout


@pytest.mark.parametrize("args, resume", [([], False), (["--resume"], True), (["--resume", "--max_steps", "3"], True),
                                          (["--resume", "false"], False)])
def test_resume_is_a_bare_flag_or_a_value(write_toml, args, resume):
    cfg, _ = load_config(["@", str(write_toml('model = "m"\n')), *args])
    assert cfg.resume is resume


def test_cpus_pin_the_program_and_what_it_starts(tmp_path):
    """[section] cpus applies before the program's main: its threads and children inherit it, and
    vLLM's worker is told to bind its OpenMP threads to the same cores."""
    import os
    import subprocess
    import sys

    core = max(os.sched_getaffinity(0))
    script = (
        "import os, sys; sys.argv[1:] = ['@', sys.argv[1]]\n"
        "from asyncrl.main import resolve; from rl.placement import pin\n"
        "cfg = resolve(sys.argv[1:], 'inference'); pin('inference.cpus', cfg.inference.cpus)\n"
        "import subprocess\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
        " capture_output=True, text=True).stdout.strip()\n"
        "print(sorted(os.sched_getaffinity(0)), child, os.environ['VLLM_CPU_OMP_THREADS_BIND'])\n"
    )
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\n[inference]\nport = {free_port()}\n'
                   f"cpus = [{core}]\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    out = subprocess.run([sys.executable, "-c", script, str(cfg)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{core}]", f"[{core}]", str(core)]


def test_a_malformed_advertise_url_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="inference.advertise_url"):
        load_config(["--model", "m", "--inference.advertise_url", "gpu7:8000"])


def test_a_saved_config_with_datasets_and_template_options_loads_as_the_same_config(write_toml):
    """What each program saves (output_dir/config/<program>.toml, read again by a multi-run
    trainer and by SLURM jobs) holds tables inside keys (chat_template_kwargs, a dataset's
    task_config) and lists of them; it must parse back to the very same config, and a key left
    unset (a dataset's sampling.temperature) must stay unset, not become its default."""
    from rl.resolved_config import render_toml

    cfg, _ = load_config(["@", str(write_toml('model = "m"\n')),
                          "--orchestrator.prompts.chat_template_kwargs", '{enable_thinking = false, "odd key" = "a\\"b"}',
                          "--orchestrator.sampling.stop", '["</s>", "\\n\\n"]',
                          "--orchestrator.datasets", '[{reasoning_gym = "spell_backward", task_config = {max_word_len = 7},'
                                                     ' reward_weights = {correct = 1.0}}, {path = "d.jsonl", reward = "math_verify"}]',
                          "--orchestrator.eval.datasets", '[{reasoning_gym = "spell_backward", seed = 10000}]'])
    again, _ = load_config(["@", str(write_toml(render_toml(cfg, omit_secrets=True), "saved.toml"))])
    assert again == cfg
    assert again.orchestrator.datasets[0].sampling.temperature is None
    assert [d.reward for d in again.orchestrator.resolved_datasets()] == ["reasoning_gym", "math_verify"]


def test_program_help_lists_its_config_keys_with_their_docs():
    """`rl trainer --help` goes on after the usage with every key the trainer reads, each with its
    docstring (wrapped); another program's table stays out."""
    from rl.config import LoRAConfig, OptimConfig, RunConfig

    result = run_rl("trainer", "--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.index("Usage:") < out.index("--trainer.optim.lr FLOAT")
    words = " ".join(out.split())
    for key, doc in (("--trainer.optim.lr", OptimConfig.model_fields["lr"].description),
                     ("--trainer.lora.rank", LoRAConfig.model_fields["rank"].description),
                     ("--seq_len", RunConfig.model_fields["seq_len"].description)):
        assert f"{key} " in out and " ".join(doc.split()) in words, key
    assert "--orchestrator.scheduling.prompts_per_step" not in out and "[inference]" not in out
    # The orchestrator's help has its own keys, and of the trainer's only the LoRA ones it reads.
    out = run_rl("orchestrator", "--help").stdout
    assert " ".join(SchedulingConfig.model_fields["group_size"].description.split()) in " ".join(out.split())
    assert "--orchestrator.scheduling.group_size " in out
    assert "--trainer.lora.rank" in out and "--trainer.optim.lr" not in out


def _tables(model: type[BaseModel], prefix: str = ""):
    """Every table of the schema, nested ones and those of [[lists]] of tables, with its path."""
    yield prefix, model
    for name, field in model.model_fields.items():
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _tables(arg, f"{prefix}{name}.")


def test_every_config_key_has_its_docstring():
    """--help and --dry-run print each key's docstring: a key added without one would print
    a bare name."""
    from rl.config import RunConfig

    tables = list(_tables(RunConfig))
    table_names = {path.rstrip(".") for path, _ in tables}
    # A table ([inference], [[orchestrator.datasets]]) is a heading, not a key.
    undocumented = [f"{path}{name}" for path, model in tables for name, field in model.model_fields.items()
                    if f"{path}{name}" not in table_names and not (field.description or "").strip()]
    assert {"orchestrator.datasets", "trainer.optim", "orchestrator.eval.datasets"} <= table_names
    assert undocumented == []


def test_dry_run_shows_unset_keys_with_their_docs(write_toml, tmp_path):
    """A key whose value is unset (None) is listed as a comment with its docs, not left out."""
    from rl.config.orchestrator_tables import TeacherConfig

    cfg = write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\n')
    out = run_rl("run", "@", str(cfg), "--dry-run").stdout
    teacher = out[out.index("[orchestrator.teacher]"):]
    assert "# url = (unset)" in teacher.split("\n\n")[0]
    doc_line = TeacherConfig.model_fields["url"].description.splitlines()[0].strip()
    assert f"# {doc_line}" in teacher
    assert "# max_off_policy_steps = (unset)" in out
