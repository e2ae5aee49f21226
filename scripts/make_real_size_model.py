"""Build real-shaped models: Qwen2.5-0.5B's architecture with random (seeded) weights, and a
byte-level BPE tokenizer trained here with Qwen2.5's special tokens at Qwen2.5's ids and a ChatML
template that renders tools. Nothing is downloaded.

    python scripts/make_real_size_model.py                    # models/qwen-shape-0.5b and -2l
    python scripts/make_real_size_model.py --layers 2 --check-vllm
    python scripts/make_real_size_model.py --dtype float32 --force

Artifacts, each a directory under --out with a build stamp (build.json naming the parameters it
was built with); a directory whose stamp matches is kept as it is ("cached"), --force rebuilds:
    qwen-shape-tokenizer  the tokenizer, trained once and copied into both models
    qwen-shape-0.5b       Qwen2ForCausalLM, 24 layers: hidden 896, intermediate 4864, 14 heads /
                          2 KV heads (head_dim 64), vocab 151,936, tied embeddings, rope_theta 1e6,
                          weights ~ N(0, 0.02) (transformers' init) from --seed, saved in --dtype
    qwen-shape-2l         the same with 2 layers, for tests

The tokenizer is set up as transformers' Qwen2Tokenizer (NFC, Qwen2's split regex, byte-level; all
256 bytes in its alphabet, so any text round-trips) and trained on the first --corpus-mb MB of
the local Python's standard library .py files, then the text files (.py .pyi .md .rst .txt) of
the installed packages, each set in sorted path order: the same bytes, hence the same tokenizer,
on the same machine. Qwen2.5 has 151,643 regular tokens (ids 0-151,642: 256 bytes and 151,387
merges). When a small corpus runs out of pairs to merge first, the ids left up to 151,642 are
filled with "<|unused_N|>" vocabulary entries that no text encodes to (no merge builds them), so
that the special tokens keep Qwen2.5's ids and len(tokenizer) is Qwen2.5's 151,665:
<|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, <|object_ref_start|> ...
<|video_pad|> up to 151656, then <tool_call> 151657, </tool_call> 151658, <|fim_prefix|> ...
<|file_sep|> 151664, the last eight not special (as in Qwen2.5: decoding with
skip_special_tokens keeps a tool call's tags). Ids 151,665-151,935 have no token, as in Qwen2.5;
a random model samples them now and then, and vLLM decodes them to "".

Measured here (2 cores, Python 3.11 whose stdlib .py files are 31.5 MB, other jobs running):
    --corpus-mb   merges learnt        training   RSS
    2 (the test)   25,435                 1-2 s   -
    10             68,304                   6 s   0.2 GB
    30            142,587                  10 s   0.3 GB
    35            151,387 (all of them)     9 s   0.3 GB
    100 (default) 151,387                19-31 s  0.5 GB   (stdlib + site-packages up to numba/)
Then the 0.5B model builds in 10-14 s (1.0 GB on disk in bfloat16), the 2-layer one in 3-6 s
(0.34 GB; 0.67 GB in float32): ~50 s for everything, 3 GB of memory at most.

--check-vllm (~50 s) loads the 2-layer model in transformers and in vLLM (CPU, float32) and
continues a chat prompt with tools greedily for 8 tokens in both. Measured: the same 8 tokens,
logprobs within 2e-6 (a tied lm_head that vLLM got wrong would not agree), and id 151,935
decoded to "" without error.
The chat template is scripts/chat_template.jinja (ChatML with Qwen2.5's Hermes-style tools: the
tools' JSON schemas in a system message inside <tools></tools>, calls as <tool_call>{"name": ...,
"arguments": ...}</tool_call>, tool results as user turns inside <tool_response></tool_response>),
stored as tokenizer_config.json's "chat_template". eos is <|im_end|>, pad <|endoftext|>, as in
Qwen2.5-Instruct; generation_config.json stops at either.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

CHAT_TEMPLATE_FILE = Path(__file__).parent / "chat_template.jinja"
BUILD_STAMP = "build.json"
STAMP_VERSION = 1  # bump when the recipe changes, so cached directories are rebuilt

REGULAR_TOKENS = 151_643  # Qwen2.5's byte-level BPE vocabulary (ids 0..151,642)
VOCAB_SIZE = 151_936      # its embedding rows: the special tokens, then padding to a multiple of 128
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2.5's added tokens in id order from 151,643; the first 14 special, the last 8 not.
SPECIAL = [ENDOFTEXT, IM_START, IM_END, "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
           "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
NOT_SPECIAL = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
               "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]

# Qwen2.5-0.5B-Instruct's config.json (its eos is <|im_end|>; the base model's <|endoftext|>), but
# for num_hidden_layers.
SHAPE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
    num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    use_sliding_window=False, sliding_window=None, attention_dropout=0.0, initializer_range=0.02,
    bos_token_id=REGULAR_TOKENS, eos_token_id=REGULAR_TOKENS + 2,  # <|endoftext|>, <|im_end|>
)
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".rst", ".txt"}


# --- corpus ----------------------------------------------------------------------------------

def corpus_files(cap_bytes: int) -> list[tuple[Path, str, int]]:
    """(root, relative path, bytes to read) of the corpus, in order, up to cap_bytes: the stdlib's
    .py files, then the installed packages' text files; the last one cut at the cap."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    packages = Path(sysconfig.get_paths()["purelib"])
    sources = [(stdlib, {".py"}, "site-packages"), (packages, TEXT_SUFFIXES, None)]
    files, total = [], 0
    for root, suffixes, skip in sources:
        paths = sorted(p for p in root.rglob("*") if p.suffix in suffixes and p.is_file()
                       and (skip is None or skip not in p.relative_to(root).parts))
        for path in paths:
            if total >= cap_bytes:
                return files
            size = min(path.stat().st_size, cap_bytes - total)
            files.append((root, path.relative_to(root).as_posix(), size))
            total += size
    return files


def corpus_fingerprint(files: list[tuple[Path, str, int]]) -> str:
    """Names and sizes, not contents: cheap enough to check on every run, and a reinstalled
    package of another version changes its files' sizes."""
    digest = hashlib.sha256()
    for root, rel, size in files:
        digest.update(f"{root.name}/{rel}\0{size}\0".encode())
    return digest.hexdigest()[:16]


def read_corpus(files: list[tuple[Path, str, int]]):
    for root, rel, size in files:
        with open(root / rel, "rb") as f:
            yield f.read(size).decode("utf-8", errors="replace")


# --- tokenizer -------------------------------------------------------------------------------

def train_tokenizer(files: list[tuple[Path, str, int]]):
    """Qwen2's byte-level BPE recipe (as transformers' Qwen2Tokenizer builds it), trained on the
    corpus for up to REGULAR_TOKENS tokens; returns the tokenizers.Tokenizer and its size."""
    from make_chat_model import qwen2_bpe
    from tokenizers import pre_tokenizers, trainers

    tok = qwen2_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=REGULAR_TOKENS,
        special_tokens=[],  # added after training, at Qwen2.5's ids
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes, no <unk>
        show_progress=False,
    )
    tok.train_from_iterator(read_corpus(files), trainer)
    return tok, tok.get_vocab_size()


def with_qwen_ids(tok):
    """Fill the regular ids the corpus left empty with tokens no text encodes to (vocabulary
    entries that no merge builds), then add the special tokens, which thus get Qwen2.5's ids."""
    from tokenizers import AddedToken, Tokenizer

    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for i in range(len(vocab), REGULAR_TOKENS):
        vocab[f"<|unused_{i}|>"] = i
    tok = Tokenizer.from_str(json.dumps(state))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NOT_SPECIAL])
    for i, token in enumerate(SPECIAL + NOT_SPECIAL):
        assert tok.token_to_id(token) == REGULAR_TOKENS + i, (token, tok.token_to_id(token))
    return tok


def build_tokenizer(out: Path, files: list[tuple[Path, str, int]]) -> str:
    """Train and save the tokenizer (tokenizer.json, tokenizer_config.json with the template)."""
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    tok, trained = train_tokenizer(files)
    seconds = time.perf_counter() - start
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=with_qwen_ids(tok), eos_token=IM_END, pad_token=ENDOFTEXT,
        additional_special_tokens=SPECIAL[1:],  # as Qwen2.5's tokenizer_config.json
        chat_template=CHAT_TEMPLATE_FILE.read_text(), model_max_length=SHAPE["max_position_embeddings"],
    )
    # save_jinja_files=False: the template goes into tokenizer_config.json, as make_chat_model.py
    # saves it, where readers without transformers find it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    mb = sum(size for _, _, size in files) / 1e6
    return (f"{len(files)} files, {mb:.1f} MB -> {trained} regular tokens ({trained - 256} merges) "
            f"in {seconds:.1f} s; {REGULAR_TOKENS - trained} filled; len(tokenizer) {len(tokenizer)}")


# --- model -----------------------------------------------------------------------------------

def build_model(out: Path, stamp: dict, tokenizer_dir: Path) -> str:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # "Writing model shards" bars; the artifact's line says enough

    layers = stamp["layers"]
    config = Qwen2Config(**SHAPE, num_hidden_layers=layers, max_window_layers=layers)
    torch.manual_seed(stamp["seed"])
    # Built in float32 and then cast, so both dtypes hold the same weights up to rounding.
    model = Qwen2ForCausalLM(config).to(getattr(torch, stamp["dtype"]))
    endoftext, im_end = REGULAR_TOKENS, REGULAR_TOKENS + 2
    # As Qwen2.5-Instruct: generation stops at <|im_end|> or <|endoftext|>. Token ids only, no
    # sampling defaults: vLLM applies a model's generation_config to every request.
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name != BUILD_STAMP:
            shutil.copy2(f, out / f.name)
    params = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    return f"{params / 1e6:.1f}M parameters, {stamp['dtype']}"


# --- artifacts: cache, build, report ---------------------------------------------------------

def disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def artifact(out: Path, stamp: dict, force: bool, build) -> None:
    """Build `out` with build(directory, stamp) unless it holds this stamp already. It is built
    in a sibling directory and renamed into place, stamp last, so an interrupted build never
    looks finished; a directory without a stamp (not ours) is replaced only with --force."""
    stamp_path = out / BUILD_STAMP
    if out.exists() and not force:
        if not stamp_path.exists():
            sys.exit(f"{out} exists without {BUILD_STAMP}: not built by this script; --force replaces it")
        if json.loads(stamp_path.read_text()) == stamp:
            print(f"{out}: cached, {disk_mb(out):.1f} MB on disk (build stamp matches)", flush=True)
            return
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    detail = build(tmp, stamp)
    (tmp / BUILD_STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"{out}: built in {time.perf_counter() - start:.1f} s, {disk_mb(out):.1f} MB on disk; {detail}",
          flush=True)


# --- checks ----------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "Sunny, 21 C"},
]


def check(out: Path, new_tokens: int = 8) -> None:
    """transformers and vLLM (CPU, float32) load the model and continue a chat-rendered prompt
    with tools greedily; prints both continuations and how far they agree (random weights: the
    logits lie close together, so fp32 kernels may part ways after some tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    hf, hf_logprobs = [], []
    with torch.no_grad():  # greedy by hand: no stop token, no generation_config in the way
        for _ in range(new_tokens):
            logprobs = model(torch.tensor([ids + hf])).logits[0, -1].log_softmax(-1)
            hf.append(int(logprobs.argmax()))
            hf_logprobs.append(float(logprobs[hf[-1]]))
    print(f"transformers: {type(model).__name__}, tied lm_head {tied}; {len(ids)} prompt tokens -> {hf}")
    del model

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # On CPU, gpu_memory_utilization is the share of the machine's memory the engine may claim:
    # it refuses to start when other programs hold more than the rest (as make_tool_model.py).
    # 1 GiB of KV cache holds 2048 tokens of this shape many times over.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=str(out), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.2)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    got = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy)[0].outputs[0]
    same = next((i for i, (a, b) in enumerate(zip(hf, got.token_ids)) if a != b), len(hf))
    diff = max((abs(lp[t].logprob - h) for t, lp, h in zip(got.token_ids[:same], got.logprobs, hf_logprobs)),
               default=float("nan"))
    print(f"vLLM: {list(got.token_ids)} -> {got.text!r}; first {same}/{len(hf)} tokens as transformers "
          f"(logprob difference on them at most {diff:.2e})")
    # A random model samples ids past the tokenizer's 151,665 now and then (Qwen2.5's ids
    # 151,665-151,935 have no token either): vLLM must detokenize them without dying.
    past = SamplingParams(temperature=0.0, max_tokens=2, allowed_token_ids=[VOCAB_SIZE - 1])
    try:
        text = llm.generate([TokensPrompt(prompt_token_ids=ids)], past)[0].outputs[0]
        print(f"vLLM, id {VOCAB_SIZE - 1} (no token): {list(text.token_ids)} -> {text.text!r}")
    except Exception as exc:  # report and go on: loading and generating were the point
        print(f"vLLM, id {VOCAB_SIZE - 1} (no token): {type(exc).__name__}: {exc}")


# --- main ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", choices=["24", "2", "both"], default="both")
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--corpus-mb", type=int, default=100, help="cap on the tokenizer's training text")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--force", action="store_true", help="rebuild even when a build stamp matches")
    ap.add_argument("--check-vllm", action="store_true",
                    help="load the 2-layer model in transformers and vLLM and generate a few tokens")
    args = ap.parse_args()
    layers = {"24": [24], "2": [2], "both": [24, 2]}[args.layers]
    if args.check_vllm and 2 not in layers:
        ap.error("--check-vllm checks the 2-layer model: give --layers 2 or both")

    files = corpus_files(args.corpus_mb * 1_000_000)
    tok_stamp = {"script": Path(__file__).name, "version": STAMP_VERSION, "corpus_mb": args.corpus_mb,
                 "corpus": corpus_fingerprint(files), "template": hashlib.sha256(
                     CHAT_TEMPLATE_FILE.read_bytes()).hexdigest()[:16]}
    tokenizer_dir = args.out / "qwen-shape-tokenizer"
    artifact(tokenizer_dir, tok_stamp, args.force, lambda d, _: build_tokenizer(d, files))
    for n in layers:
        stamp = {**tok_stamp, "layers": n, "dtype": args.dtype, "seed": args.seed}
        out = args.out / ("qwen-shape-0.5b" if n == 24 else f"qwen-shape-{n}l")
        artifact(out, stamp, args.force, lambda d, s: build_model(d, s, tokenizer_dir))
    if args.check_vllm:
        check(args.out / "qwen-shape-2l")


if __name__ == "__main__":
    main()
