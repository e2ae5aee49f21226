"""Build the character-level models: a Qwen2 with a character tokenizer (no chat template),
trained briefly with supervised learning on a task until it has partial skill, so RL has room to
improve it. This script builds the tokenizer and the untrained model (<out>-init); the training is
`rl sft` on the task's config, which it runs, and whose last weights it copies into --out.

    python scripts/make_tiny_model.py                                  # models/tiny-reverse (0.8M)
    python scripts/make_tiny_model.py --task count --out models/long-count   # 14M, 128-256-token answers
    python scripts/make_tiny_model.py --task reverse-moe --out models/tiny-moe   # a 4-expert Qwen3-MoE
    python scripts/make_tiny_model.py --max_steps 400                  # unknown options go to rl sft

configs/sft_tiny_reverse.toml and configs/sft_long_count.toml say how long each trains, and
measure the held-out greedy reward by generation as they go (metrics.jsonl of their run).
Everything is built offline and seeded: running it twice gives the same model on the same machine.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig

from tasks import count, reverse
from rl.rundir import RunDir

# task -> (its module, the model's shape, the rl sft config that trains it)
TASKS = {"reverse": (reverse, "tiny", "configs/sft_tiny_reverse.toml"),
         "count": (count, "long", "configs/sft_long_count.toml"),
         "reverse-moe": (reverse, "moe", "configs/sft_tiny_moe.toml")}
DEFAULT_OUT = {"reverse": "models/tiny-reverse", "count": "models/long-count", "reverse-moe": "models/tiny-moe"}
# name -> (hidden, intermediate, layers, attention heads, kv heads); head_dim 32 throughout, the
# smallest vLLM's CPU attention supports.
SHAPES = {"tiny": (128, 384, 4, 4, 2), "long": (384, 1152, 8, 12, 4), "moe": (128, 384, 4, 4, 2)}
# The MoE shape's experts: (experts, experts per token, each expert's intermediate size). vLLM's CPU
# MoE kernel wants hidden and expert intermediate sizes that are multiples of 32 (it pads others at
# load, and a padded layer breaks its reload).
MOE = (4, 2, 128)
# Router weights' init std: logits ~ N(0, 128 * 0.1^2) ~ +-1.1 apart, so each token's top 2 of 4
# are clear from the start. HF's default (0.02) leaves them near ties, which float rounding flips
# between vLLM and transformers: what routing replay is for, but not where a model should start.
ROUTER_STD = 0.1

SPECIAL = ["<pad>", "<eos>", "<unk>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(reverse.ALPHABET + reverse.SEPARATOR))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # One token per character; decoding concatenates them with no spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_model(tokenizer: PreTrainedTokenizerFast, shape: str = "tiny"):
    if shape == "moe":
        return build_moe_model(tokenizer)
    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256 if shape == "tiny" else 512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def build_moe_model(tokenizer: PreTrainedTokenizerFast):
    """A Qwen3-MoE (vLLM's Qwen3MoeForCausalLM) of the tiny shape, every layer's MLP a mixture of
    MOE experts with softmax top-k routing, renormalised over the chosen ones (norm_topk_prob)."""
    from transformers import Qwen3MoeForCausalLM

    hidden, intermediate, layers, heads, kv_heads = SHAPES["moe"]
    experts, per_token, expert_size = MOE
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=expert_size,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, ROUTER_STD)
    return model


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sample: bool = False) -> list[str]:
    """One completion per prompt (ids), decoded without special tokens; greedy unless `sample`
    (T=1, no top-k, from torch's global generator)."""
    model.eval()
    texts = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, max_new_tokens=max_new_tokens,
            **({"do_sample": True, "temperature": 1.0, "top_k": 0} if sample else {"do_sample": False}),
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    model.train()
    return texts


def mean_reward(model, tokenizer, task, rows: list[dict], sample: bool = False) -> float:
    prompts = [tokenizer.encode(row["prompt"]) for row in rows]
    texts = generate(model, tokenizer, prompts, task.MAX_ANSWER + 2, sample)
    return sum(task.reward(row["prompt"], text, row) for row, text in zip(rows, texts)) / len(rows)


def train_with_rl_sft(init: Path, out: Path, config: Path, run: Path, extra: list[str]) -> Path:
    """`rl sft @ config` on the untrained model; its last weights plus the tokenizer into `out`."""
    cmd = [sys.executable, "-m", "asyncrl", "sft", "@", str(config), "--model", str(init), "--output_dir", str(run),
           *extra]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    weights = RunDir(run).weights_dir(max(RunDir(run).stable_weight_steps()))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy2(weights / name, out / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(init / name, out / name)
    return weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="reverse")
    ap.add_argument("--out", type=Path, help="default: models/tiny-reverse, models/long-count")
    ap.add_argument("--init", type=Path, help="the untrained model (default: <out>-init)")
    ap.add_argument("--run", type=Path, help="rl sft's output_dir (default: the config's)")
    ap.add_argument("--seed", type=int, default=1234, help="the untrained model's weights, the sampled answers")
    args, extra = ap.parse_known_args()  # the rest goes to rl sft (--max_steps 400, ...)

    task, shape, config = TASKS[args.task]
    out = args.out or Path(DEFAULT_OUT[args.task])
    init = args.init or out.with_name(out.name + "-init")
    run = args.run or Path("runs") / Path(config).stem
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, shape)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    init.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(init, safe_serialization=True)
    tokenizer.save_pretrained(init)

    start = time.perf_counter()
    weights = train_with_rl_sft(init, out, Path(config), run, extra)
    print(f"rl sft: {time.perf_counter() - start:.1f} s; {weights} -> {out}")
    trained = AutoModelForCausalLM.from_pretrained(out)
    rows = list(task.heldout(0))
    greedy = mean_reward(trained, tokenizer, task, rows)
    torch.manual_seed(args.seed)
    sampled = mean_reward(trained, tokenizer, task, rows, sample=True)
    print(f"saved {out}: held-out ({len(rows)} rows) greedy reward {greedy:.3f}, sampled (T=1) {sampled:.3f}")


if __name__ == "__main__":
    main()
