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


def test_rl_eval_gives_the_same_greedy_numbers_for_the_same_weights(tmp_path):
    """`--step all`: the model (step 0) on a fresh server, then step 1 (the same weights) reloaded
    into it from a link in the server's scratch run."""
    run = tmp_path / "run"
    published = run / "weights" / "step_1"
    shutil.copytree(CHAT_MODEL, published)
    (published / "STABLE").touch()
    (run / "weights" / "step_2").mkdir()  # being written: no STABLE, not evaluated
    cfg = write_config(tmp_path / "cfg.toml", CHAT_MODEL, run)
    result = subprocess.run(rl_command("eval", "@", str(cfg), "--step", "all"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 0:\n" in result.stdout and "step 2:" not in result.stdout, result.stdout
    step_0, step_1 = result.stdout.split("step 0:\n")[1].split("step 1:\n")
    assert step_0 == step_1 and "heldout/accuracy: " in step_0, result.stdout
    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [(r["step"], r["version"], r["weights"]) for r in records] == [(0, 0, str(CHAT_MODEL)),
                                                                           (1, 1, str(published))]
    assert records[0]["eval/heldout/rows"] == 30 and 0 <= records[0]["eval/heldout/accuracy"] <= 1
    assert {k: v for k, v in records[0].items() if k.startswith("eval/")} == \
        {k: v for k, v in records[1].items() if k.startswith("eval/")}
    assert published.joinpath("model.safetensors").stat().st_nlink == 1, "the link was left behind"
    assert not list((run / "eval").glob("server-*")), "the scratch server directory was left behind"

    never = subprocess.run(rl_command("eval", "@", str(cfg), "--step", "2"), capture_output=True, text=True,
                           timeout=60)
    assert never.returncode == 2 and "--step 2: " in never.stderr and "no STABLE" in never.stderr


def test_rl_eval_of_a_lora_step_loads_its_adapter_on_the_base_model(tmp_path):
    """A LoRA run's weights/step_N is an adapter: `rl eval --step N` serves the base model with it,
    and gets what the same adapter merged into the weights gets, which is not the base model's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    published = run / "weights" / "step_3"
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(CHAT_MODEL, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft starts lora_B at zero, which would change nothing
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(published)
    (published / "STABLE").touch()
    merged = tmp_path / "merged"
    model.merge_and_unload().save_pretrained(merged)
    for f in CHAT_MODEL.iterdir():  # the tokenizer and its template
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, merged / f.name)

    def evaluate(model_dir, *extra, steps: int = 1) -> list[dict]:
        """The eval/ numbers of the last `steps` records the run wrote."""
        cfg = write_config(tmp_path / "cfg.toml", model_dir, run)
        result = subprocess.run(rl_command("eval", "@", str(cfg), *extra), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()[-steps:]]
        return [{k: v for k, v in record.items() if k.startswith("eval/") or k == "step"} for record in records]

    # One server: the base model (step 0), then step 3's adapter loaded by name.
    base, lora = evaluate(CHAT_MODEL, "--trainer.lora.rank", "8", "--step", "3,0", steps=2)
    (as_merged,) = evaluate(merged)
    assert (base["step"], lora["step"], as_merged["step"]) == (0, 3, 0)
    # Merged weights and base + adapter agree to rounding; a greedy pick may flip where two
    # logits tie to the last bits, so one row of the 30 may score differently.
    assert abs(lora["eval/heldout/reward"] - as_merged["eval/heldout/reward"]) <= 1 / 30
    assert abs(lora["eval/heldout/reward"] - base["eval/heldout/reward"]) > 2 / 30, (lora, base)
    assert not list((run / "eval").glob("server-*")), "the scratch server directory was left behind"
