"""Build models/tiny-chat: a 0.8M-parameter Qwen2 with a ChatML chat template and a small BPE
tokenizer, trained briefly with supervised learning on a reasoning-gym task rendered through that
template, until it has partial skill (so RL has room to improve it). This script builds the
tokenizer and the untrained model (models/tiny-chat-init); the training is `rl sft @
configs/sft_tiny_chat.toml`, which it runs, and whose last weights it copies into --out.

    python scripts/make_chat_model.py                      # writes models/tiny-chat
    python scripts/make_chat_model.py --check-vllm         # then checks vLLM's greedy answers
    python scripts/make_chat_model.py --max_steps 300      # unknown options go to rl sft

The task, for the RL config to use the same held-out set:
    reasoning_gym.create_dataset(TASK, size=..., seed=..., **TASK_KWARGS)
    TASK = "spell_backward", TASK_KWARGS = {"min_word_len": 3, "max_word_len": 7}
    held-out eval: seed EVAL_SEED = 10_000, EVAL_ROWS = 100 rows
    SFT rows: seed SFT_SEED = 1_000_000 (configs/sft_tiny_chat.toml)
reasoning-gym's row idx of a dataset with seed s is drawn from Random(s + idx), so datasets with
seeds s and s' overlap when their index ranges meet: RL runs (seed 0..10) stay clear of the
held-out rows as long as seed + size <= 10_000. Rows are scored by the task's own
`dataset.score_answer(completion_text, entry)`: 1.0 for an exact (case-insensitive) answer,
else 1/len(answer) per letter in its right position; not stripped, so a leading space costs.

Chat format: messages = [{"role": "user", "content": entry["question"]}]; the prompt is
`tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)`, the target
entry["answer"] + "<|im_end|>". The template is the `chat_template` key of tokenizer_config.json.
Everything is built offline and seeded: running it twice gives the same model on the same machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import reasoning_gym
import torch
from make_tiny_model import build_model, generate, train_with_rl_sft
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX


TASK = "spell_backward"
TASK_KWARGS = {"min_word_len": 3, "max_word_len": 7}
SFT_SEED = 1_000_000
EVAL_SEED, EVAL_ROWS = 10_000, 100
# Longest answer (max_word_len letters) plus <|im_end|>, with one token to spare.
MAX_NEW_TOKENS = TASK_KWARGS["max_word_len"] + 2
MAX_MODEL_LEN = 128

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2.5-Instruct's ChatML and its Hermes-style tool calls, without its default system prompt (a
# system message is rendered only when given, which keeps the prompts short) and with a shorter
# tool preamble. Without tools it renders what plain ChatML does.
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()


def qwen2_bpe() -> Tokenizer:
    """An untrained byte-level BPE set up exactly as transformers' Qwen2Tokenizer (NFC, Qwen2's split
    regex, byte-level), so AutoTokenizer gives the same ids whether it reads tokenizer.json or
    rebuilds the tokenizer from the Qwen2 recipe. The tool and real-size models train the same one."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """qwen2_bpe(), its merges are learnt from the chat roles and the task's
    instruction only: the instruction's words become one token each, while the words to spell
    (new every row) stay mostly single letters, which a 0.8M model can learn to reverse."""
    tok = qwen2_bpe()
    instruction = task_dataset(EVAL_SEED, 1)[0]["question"].rsplit(" ", 1)[0]  # without the word
    trainer = trainers.BpeTrainer(
        vocab_size=1000,  # never reached: merging stops once each training word is one token
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes, no <unk>
        show_progress=False,
    )
    tok.train_from_iterator(["system", "user", "assistant", "\n", instruction], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_MODEL_LEN,
    )


def task_dataset(seed: int, size: int):
    return reasoning_gym.create_dataset(TASK, size=size, seed=seed, **TASK_KWARGS)


def prompt_ids(tokenizer, entry: dict) -> list[int]:
    messages = [{"role": "user", "content": entry["question"]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def mean_reward(model, tokenizer, dataset, entries: list[dict], sample: bool = False) -> float:
    texts = generate(model, tokenizer, [prompt_ids(tokenizer, e) for e in entries], MAX_NEW_TOKENS, sample)
    return sum(dataset.score_answer(t, e) for t, e in zip(texts, entries)) / len(entries)


def save(model, tokenizer, out: Path) -> None:
    im_end, endoftext = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    # As Qwen2.5-Instruct: generation stops at <|im_end|> or <|endoftext|>. Token ids only, no
    # sampling defaults: vLLM applies a model's generation_config to every request.
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext)
    model.save_pretrained(out, safe_serialization=True)
    # save_jinja_files=False: the template goes into tokenizer_config.json ("chat_template"),
    # where readers without transformers find it beside the special tokens, rather than into
    # transformers 5's separate chat_template.jinja.
    tokenizer.save_pretrained(out, save_jinja_files=False)


def check_tokenizer(out: Path, trained_with, entries: list[dict]) -> None:
    """The saved tokenizer, as AutoTokenizer loads it (and tokenizer.json alone, on the rendered
    text), encodes the prompts as trained; a whole conversation is the prompt, the target and the
    template's closing newline."""
    saved = AutoTokenizer.from_pretrained(out)
    rust = Tokenizer.from_file(str(out / "tokenizer.json"))  # what the orchestrator reads
    for entry in entries:
        p = prompt_ids(trained_with, entry)
        assert prompt_ids(saved, entry) == p, entry["question"]
        messages = [{"role": "user", "content": entry["question"]}]
        text = saved.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rust.encode(text, add_special_tokens=False).ids == p, text
        answer = trained_with.encode(entry["answer"] + IM_END, add_special_tokens=False)
        chat = messages + [{"role": "assistant", "content": entry["answer"]}]
        assert saved.apply_chat_template(chat, return_dict=False) == p + answer + saved.encode("\n"), chat
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and not (out / "chat_template.jinja").exists()
    print(f"tokenizer: {type(saved).__name__} gives the trained ids on {len(entries)} prompts")


def check_vllm(out: Path, tokenizer, dataset, entries: list[dict], hf_texts: list[str]) -> None:
    """vLLM's greedy answers to the same chat prompts: they should stop at <|im_end|> (from
    generation_config.json) and score about as HF's do (fp32 kernels differ slightly)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=prompt_ids(tokenizer, e)) for e in entries]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
    texts = [o.outputs[0].text for o in outs]
    stopped = sum(o.outputs[0].token_ids[-1] == tokenizer.eos_token_id for o in outs)
    same = sum(a == b for a, b in zip(texts, hf_texts))
    score = sum(dataset.score_answer(t, e) for t, e in zip(texts, entries)) / len(entries)
    print(f"vLLM greedy reward {score:.3f}; stopped at <|im_end|>: {stopped}/{len(entries)}; "
          f"same text as HF: {same}/{len(entries)}; e.g. {outs[0].outputs[0].token_ids} -> {texts[0]!r}")


def report(out: Path, tokenizer, entries: list[dict]) -> None:
    print(f"vocab {len(tokenizer)}; special ids: " + ", ".join(
        f"{t}={tokenizer.convert_tokens_to_ids(t)}" for t in (ENDOFTEXT, IM_START, IM_END)))
    print("files: " + ", ".join(f"{f.name} {f.stat().st_size}" for f in sorted(out.iterdir())))
    lengths = [len(prompt_ids(tokenizer, e)) + len(tokenizer.encode(e["answer"])) + 1 for e in entries]
    print(f"prompt+answer tokens, held-out rows: max {max(lengths)}, mean {sum(lengths) / len(lengths):.1f}")
    for entry in entries[:2]:
        ids = prompt_ids(tokenizer, entry)
        print(f"{len(ids)} prompt tokens: {tokenizer.convert_ids_to_tokens(ids)} -> "
              f"{tokenizer.tokenize(entry['answer'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny-chat"))
    ap.add_argument("--init", type=Path, default=Path("models/tiny-chat-init"), help="the untrained model")
    ap.add_argument("--config", type=Path, default=Path("configs/sft_tiny_chat.toml"))
    ap.add_argument("--run", type=Path, default=Path("runs/sft_tiny_chat"), help="rl sft's output_dir")
    ap.add_argument("--seed", type=int, default=1234, help="the untrained model's weights")
    ap.add_argument("--check-vllm", action="store_true", help="also load the saved model in vLLM")
    args, extra = ap.parse_known_args()  # the rest goes to rl sft (--max_steps 300, ...)

    torch.manual_seed(args.seed)
    tokenizer = build_chat_tokenizer()
    model = build_model(tokenizer, "tiny")
    model.config.bos_token_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)  # as Qwen2.5's config
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M")
    held_out = task_dataset(EVAL_SEED, EVAL_ROWS)
    eval_rows = list(held_out)
    save(model, tokenizer, args.init)
    check_tokenizer(args.init, tokenizer, eval_rows + list(task_dataset(SFT_SEED, 200)))

    start = time.perf_counter()
    weights = train_with_rl_sft(args.init, args.out, args.config, args.run, extra)
    print(f"rl sft: {time.perf_counter() - start:.1f} s; {weights} -> {args.out}")
    trained = AutoModelForCausalLM.from_pretrained(args.out)
    torch.manual_seed(args.seed)
    greedy = mean_reward(trained, tokenizer, held_out, eval_rows)
    sampled = mean_reward(trained, tokenizer, held_out, eval_rows, sample=True)
    print(f"saved {args.out}: held-out greedy reward {greedy:.3f}, sampled (T=1) {sampled:.3f}")
    report(args.out, tokenizer, eval_rows)
    if args.check_vllm:
        hf_texts = generate(trained, tokenizer, [prompt_ids(tokenizer, e) for e in eval_rows], MAX_NEW_TOKENS)
        check_vllm(args.out, tokenizer, held_out, eval_rows, hf_texts)


if __name__ == "__main__":
    main()
