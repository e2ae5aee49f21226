"""`rl eval` (orchestrator/evaluation/command.py) on real vLLM: a model and the same weights published as
a run's weights/step_1, evaluated one after the other on one server, give the same greedy numbers;
what it measured lands in evals.jsonl; weights that were never published are refused (exit 2); a
LoRA step's adapter, loaded beside the base model, gives what its merged weights give."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, free_port, rl_command

pytestmark = pytest.mark.slow

CHAT_MODEL = ROOT / "models" / "tiny-chat"


def write_config(path: Path, model: Path, run: Path) -> Path:
    """Greedy evaluation of 30 held-out spell_backward rows on a server of rl eval's own."""
    path.write_text(f'''model = "{model}"
output_dir = "{run}"
seq_len = 64
[inference]
port = {free_port()}
dtype = "float32"
[orchestrator.sampling]
max_tokens = 10
[orchestrator.eval]
rows = 30
[[orchestrator.eval.datasets]]
name = "heldout"
reasoning_gym = "spell_backward"
task_config = {{ min_word_len = 3, max_word_len = 7 }}
seed = 10000
''')
    return path


def lora_adapter(root: Path) -> tuple[Path, Path]:
    """A LoRA run's weights/step_3 (an adapter whose lora_B is random: peft starts it at zero, which
    would change nothing) and the same adapter merged into the model's weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    published = root / "lora_run" / "weights" / "step_3"
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(CHAT_MODEL, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(published)
    (published / "STABLE").touch()
    merged = root / "merged"
    model.merge_and_unload().save_pretrained(merged)
    return published, merged


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> dict:
    """One `rl eval --step all` (one engine start) of a run whose weights/step_1 is the model
    itself, step_2 is being written (no STABLE: not evaluated) and step_4 is the LoRA adapter of
    the test below merged into the weights: what that test compares its adapter with, on this
    server rather than on one of its own."""
    tmp = tmp_path_factory.mktemp("eval_command")
    adapter, merged = lora_adapter(tmp)
    run = tmp / "run"
    published = run / "weights" / "step_1"
    shutil.copytree(CHAT_MODEL, published)
    (published / "STABLE").touch()
    (run / "weights" / "step_2").mkdir()  # being written: no STABLE, not evaluated
    shutil.copytree(merged, run / "weights" / "step_4")
    (run / "weights" / "step_4" / "STABLE").touch()
    cfg = write_config(tmp / "cfg.toml", CHAT_MODEL, run)
    result = subprocess.run(rl_command("eval", "@", str(cfg), "--step", "all"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    return {"run": run, "cfg": cfg, "stdout": result.stdout, "records": records, "adapter": adapter, "tmp": tmp}


def test_rl_eval_gives_the_same_greedy_numbers_for_the_same_weights(full_run):
    """`--step all`: the model (step 0) on a fresh server, then step 1 (the same weights) reloaded
    into it from a link in the server's scratch run (then step 4, for the LoRA test)."""
    run, cfg, stdout, records = full_run["run"], full_run["cfg"], full_run["stdout"], full_run["records"]
    published = run / "weights" / "step_1"
    assert "step 0:\n" in stdout and "step 2:" not in stdout, stdout
    step_0, step_1 = stdout.split("step 0:\n")[1].split("step 4:\n")[0].split("step 1:\n")
    assert step_0 == step_1 and "heldout/accuracy: " in step_0, stdout
    assert [(r["step"], r["version"], r["weights"]) for r in records] == [(0, 0, str(CHAT_MODEL)),
                                                                           (1, 1, str(published)),
                                                                           (4, 4, str(run / "weights" / "step_4"))]
    assert records[0]["eval/heldout/rows"] == 30 and 0 <= records[0]["eval/heldout/accuracy"] <= 1
    assert {k: v for k, v in records[0].items() if k.startswith("eval/")} == \
        {k: v for k, v in records[1].items() if k.startswith("eval/")}
    for step in (1, 4):
        assert (run / "weights" / f"step_{step}" / "model.safetensors").stat().st_nlink == 1, "the link was left behind"
    assert not list((run / "eval").glob("server-*")), "the scratch server directory was left behind"

    never = subprocess.run(rl_command("eval", "@", str(cfg), "--step", "2"), capture_output=True, text=True,
                           timeout=60)
    assert never.returncode == 2 and "--step 2: " in never.stderr and "no STABLE" in never.stderr


def test_rl_eval_of_a_lora_step_loads_its_adapter_on_the_base_model(full_run):
    """A LoRA run's weights/step_N is an adapter: `rl eval --step N` serves the base model with it,
    and gets what the same adapter merged into the weights gets (step 4 of full_run, reloaded
    into a server without LoRA), which is not the base model's."""
    run = full_run["adapter"].parents[1]
    cfg = write_config(full_run["tmp"] / "lora.toml", CHAT_MODEL, run)
    # One server: the base model (step 0), then step 3's adapter loaded by name.
    result = subprocess.run(rl_command("eval", "@", str(cfg), "--trainer.lora.rank", "8", "--step", "3,0"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    base, lora, as_merged = ({k: v for k, v in record.items() if k.startswith("eval/") or k == "step"}
                             for record in [*map(json.loads, (run / "evals.jsonl").read_text().splitlines()),
                                            full_run["records"][-1]])
    assert (base["step"], lora["step"], as_merged["step"]) == (0, 3, 4)
    # Merged weights and base + adapter agree to rounding; a greedy pick may flip where two
    # logits tie to the last bits, so one row of the 30 may score differently.
    assert abs(lora["eval/heldout/reward"] - as_merged["eval/heldout/reward"]) <= 1 / 30
    assert abs(lora["eval/heldout/reward"] - base["eval/heldout/reward"]) > 2 / 30, (lora, base)
    assert not list((run / "eval").glob("server-*")), "the scratch server directory was left behind"
