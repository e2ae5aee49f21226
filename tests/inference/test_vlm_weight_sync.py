"""Weight updates reach a vision-language model in vLLM, by every route besides files
(tests/integration/test_vlm_run.py): deltas, the broadcast, LoRA adapters on the language model. `rl run`
on the shapes task, max_async_level 0 (every token of batch n sampled at version n-1, the
weights the trainer holds when it scores it), a large learning rate and a reward that differs
within a group (the untrained model counts no shapes right: the shapes reward would give every
group one reward, no advantage, no update), so each update moves the logprobs well past the
rounding bound:
- the trainer's mismatch_kl at every step is within float32 rounding's bound (the mean k3 of
  twice the per-token tolerance of tests/integration/test_vlm_run.py, its logit scale taken at the base
  weights: the engine and the trainer agree to ~1e-6 where the bound is ~1e-5, so the scale's
  drift over two steps is far inside it), so the server scores with the trainer's new weights;
- and the tokens sampled after an update have engine logprobs that the base weights miss by
  more than that tolerance on most tokens: a server that had not taken the update would fail
  the first check.
"""

from __future__ import annotations

import json
import random
import subprocess

import numpy as np
import pytest

from rl.batch import Batch
from rl.rundir import RunDir
from float32_rounding import U
from vlm_checks import MODEL, exact_logprobs, float64_model, records, vlm_logit_error

pytestmark = pytest.mark.slow

ROUTES = {
    "delta": "[weight_sync]\ndelta = true\n",
    "broadcast": '[weight_sync]\nkind = "broadcast"\n',
    "lora": "[trainer.lora]\nrank = 8\n",
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_the_server_follows_each_update_of_a_vlm(tmp_path, route):
    from conftest import free_port, rl_command
    from tasks.shapes import make_row

    (tmp_path / "data").mkdir()
    (tmp_path / "odd_reward.py").write_text("def reward(prompt, completion, row):\n"
                                            "    return float(len(completion) % 2)\n")
    rows = [make_row(random.Random(f"sync/{i}")) for i in range(8)]
    (tmp_path / "data" / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'model = "{MODEL}"\noutput_dir = "{out}"\nmax_steps = 3\nseq_len = 96\nmax_async_level = 0\n'
                   f'[inference]\nport = {free_port()}\ndtype = "float32"\n'
                   "[orchestrator]\nscheduling.prompts_per_step = 4\nscheduling.group_size = 4\n"
                   "scheduling.filter_zero_variance = false\nsampling.max_tokens = 8\n"
                   f'[[orchestrator.datasets]]\npath = "{tmp_path / "data" / "shapes.jsonl"}"\n'
                   'reward = "odd_reward:reward"\n'
                   "[trainer]\nfiles.keep_rollouts = 5\ntorch_threads = 1\n[trainer.optim]\nlr = 5e-2\n"
                   + ROUTES[route].replace('kind = "broadcast"\n', f'kind = "broadcast"\naddress = "127.0.0.1:{free_port()}"\n'))
    result = subprocess.run(rl_command("run", "@", str(cfg)), capture_output=True, text=True, timeout=600,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunDir(out)
    vision, error = float64_model(), vlm_logit_error()
    trainer = {r["step"]: r for r in records(run, "trainer")}
    assert sorted(trainer) == [1, 2, 3]
    updated = moved = 0
    for step in (1, 2, 3):
        batch = Batch.read(run.rollout_dir(step))
        bounds = []
        for i, s in enumerate(batch.sample_slices()):
            tokens, lps = batch.tokens[s].tolist(), batch.logprobs[s]
            mask, versions = batch.loss_mask[s], batch.token_versions[s]
            lp, scale = exact_logprobs(vision, tokens, batch.sample_images(i), versions)  # the base weights
            for t in range(1, len(tokens)):
                if not mask[t]:
                    continue
                assert versions[t] == step - 1  # max_async_level 0: the trainer's current weights
                tol = 2 * error * float(scale[t - 1]) + abs(float(lps[t])) * U
                bounds.append(2 * tol)
                if versions[t] >= 1:
                    updated += 1
                    moved += abs(float(lps[t]) - float(lp[t - 1, tokens[t]])) > tol
        b = np.asarray(bounds)
        assert trainer[step]["mismatch_kl"] <= float(np.mean(np.exp(b) - b - 1)), (step, trainer[step])
    assert updated >= 16 and moved > updated // 2, (moved, updated)
    if route == "lora":  # adapters on the language model only (vLLM serves a VLM's there)
        from safetensors import safe_open

        with safe_open(run.weights_dir(3) / "adapter_model.safetensors", "pt") as f:
            names = list(f.keys())
        assert names and all(".text_model.layers." in n for n in names), [n for n in names if "text_model" not in n]
