"""Build the character-level models: a Qwen2 with a character tokenizer (no chat template),
trained briefly with supervised learning on a task until it has partial skill, so RL has room to
improve it. This script builds the tokenizer and the untrained model (<out>-init); the training is
`rl sft` on the task's config, which it runs, and whose last weights it copies into --out.

    python scripts/make_tiny_model.py                                  # models/tiny-reverse (0.8M)
    python scripts/make_tiny_model.py --task count --out models/long-count   # 14M, 128-256-token answers
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
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from orchestrator.tasks import count, reverse
from rl.rundir import RunDir

# task -> (its module, the model's shape, the rl sft config that trains it)
TASKS = {"reverse": (reverse, "tiny", "configs/sft_tiny_reverse.toml"),
         "count": (count, "long", "configs/sft_long_count.toml")}
# name -> (hidden, intermediate, layers, attention heads, kv heads); head_dim 32 throughout, the
# smallest vLLM's CPU attention supports.
SHAPES = {"tiny": (128, 384, 4, 4, 2), "long": (384, 1152, 8, 12, 4)}

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


def build_model(tokenizer: PreTrainedTokenizerFast, shape: str = "tiny") -> Qwen2ForCausalLM:
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
    cmd = [sys.executable, "-m", "rl", "sft", "@", str(config), "--model", str(init), "--output_dir", str(run),
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
    out = args.out or Path("models/tiny-reverse" if args.task == "reverse" else "models/long-count")
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
    trained = Qwen2ForCausalLM.from_pretrained(out)
    rows = list(task.heldout(0))
    greedy = mean_reward(trained, tokenizer, task, rows)
    torch.manual_seed(args.seed)
    sampled = mean_reward(trained, tokenizer, task, rows, sample=True)
    print(f"saved {out}: held-out ({len(rows)} rows) greedy reward {greedy:.3f}, sampled (T=1) {sampled:.3f}")


if __name__ == "__main__":
    main()
