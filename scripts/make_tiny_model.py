"""Build the embedded models: a Qwen2 with a character-level tokenizer, trained briefly with
supervised learning on a task until it has partial skill.

    python scripts/make_tiny_model.py --out models/tiny-reverse          # the demo's 0.8M model
    python scripts/make_tiny_model.py --task count --shape long ...       # 14M, 128-256-token answers
                                  (the benchmarks' recipe: LONG_RECIPE in benchmarks/rl_runs.py)

It stops as soon as the greedy mean reward on held-out prompts reaches --target (default 0.45), so
RL has room to improve it. Everything is built offline and seeded: running it twice gives the same
model on the same machine.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from orchestrator.tasks import count, reverse

TASKS = {"reverse": reverse, "count": count}
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


def encode_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad prompt+answer+eos; labels are -100 except on the answer and eos."""
    seqs, labels = [], []
    for row in rows:
        p = tokenizer.encode(row["prompt"])
        a = tokenizer.encode(row["answer"]) + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    return ids, lab


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sample: bool = False) -> list[str]:
    """One completion per prompt (ids), decoded without special tokens; greedy unless `sample`
    (T=1, no top-k, from torch's global generator)."""
    model.eval()
    texts = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=sample, temperature=1.0, top_k=0,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    model.train()
    return texts


def mean_reward(model, tokenizer, task, rows: list[dict], sample: bool = False) -> float:
    prompts = [tokenizer.encode(row["prompt"]) for row in rows]
    texts = generate(model, tokenizer, prompts, task.MAX_ANSWER + 2, sample)
    return sum(task.reward(row["prompt"], text, row) for row, text in zip(rows, texts)) / len(rows)


def add_sft_args(ap: argparse.ArgumentParser) -> None:
    """The supervised run's options, shared with make_chat_model.py (which changes some defaults)."""
    ap.add_argument("--eval-rows", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.45, help="stop at this greedy reward")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--label-smoothing", type=float, default=0.3)


def sft(model, next_batch, evaluate, args: argparse.Namespace) -> float:
    """Train on `next_batch()`'s (ids, labels) until `evaluate()` (the greedy held-out reward,
    run every --eval-every steps) reaches --target or --max-steps pass; returns the last score."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    score = 0.0
    for step in range(1, args.max_steps + 1):
        ids, labels = next_batch()
        logits = model(input_ids=ids).logits[:, :-1]
        # Label smoothing keeps the sampling distribution broad: the model's greedy answer has
        # partial skill while its samples at T=1 are much worse, the regime where RL's gains
        # show quickly (TRL's reference model: 0.50 greedy, 0.21 sampled).
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
            ignore_index=-100, label_smoothing=args.label_smoothing)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % args.eval_every == 0:
            score = evaluate()
            print(f"step {step} loss {loss.item():.3f} greedy reward {score:.3f}", flush=True)
            if score >= args.target:
                break
    return score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny-reverse"))
    ap.add_argument("--task", choices=sorted(TASKS), default="reverse")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    add_sft_args(ap)
    args = ap.parse_args()

    task = TASKS[args.task]
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.shape)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    rng = random.Random(args.seed)
    # Held-out prompts come from another seed than the RL runs' (which use the config's seed).
    eval_rows = [task.make_row(random.Random(10_000 + i)) for i in range(args.eval_rows)]

    score = sft(
        model,
        lambda: encode_batch(tokenizer, [task.make_row(rng) for _ in range(args.batch_size)]),
        lambda: mean_reward(model, tokenizer, task, eval_rows),
        args,
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    torch.manual_seed(args.seed)
    sampled = mean_reward(model, tokenizer, task, eval_rows, sample=True)
    print(f"saved {args.out}: greedy reward {score:.3f}, sampled (T=1) {sampled:.3f}")


if __name__ == "__main__":
    main()
