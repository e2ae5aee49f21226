"""Build models/tiny-tool: a 0.84M-parameter Qwen2 chat model (byte-level BPE, the ChatML template
with Hermes-style tool calls of scripts/chat_template.jinja) trained briefly with supervised
learning to answer reasoning-gym arithmetic questions by calling a calculator tool
(tasks/calculator.py), until it has partial skill, so RL with the orchestrator's
tool loop has room to improve it. This script builds the tokenizer and the untrained model
(models/tiny-tool-init); the training is `rl sft @ configs/sft_tiny_tool.toml`, which it runs
(its held-out greedy episodes every 100 steps in runs/sft_tiny_tool/metrics.jsonl), and whose
last weights it copies into --out. Then it plays the held-out episodes in HF, greedy and sampled.

    python scripts/make_tool_model.py                     # writes models/tiny-tool
    python scripts/make_tool_model.py --check-vllm        # then plays the episodes in vLLM too
    python scripts/make_tool_model.py --max_steps 1500    # unknown options go to rl sft

An SFT conversation (calculator.sft_rows), rendered by the template with tools=[the calculate
tool's schema]:

    user: "Calculate -9*-9-7."
    assistant: "" + tool call calculate(expression="-9*-9-7")
    tool: "74"
    assistant: "74"

or, for 40% of the rows, the answer at once without calling the tool (right, but the model
cannot work it out, so these mostly teach it wrong guesses): sampling at T=1 it then calls the
tool only part of the time, and RL can teach it to always call it. rl sft's loss is on the
assistant turns only (their content, the tool-call text and the <|im_end|> ending each turn).

Skill is measured on episodes played as the orchestrator plays them (orchestrator/
tool_episode.py): the model's turn is generated until <|im_end|>, its <tool_call>s parsed with
the hermes parser and run, the template's text for the tool messages appended, and so on for up
to MAX_TURNS model turns; the reward is Calculator.reward on the resulting messages. Held-out
rows: calculator.rows(EVAL_SEED, EVAL_ROWS); SFT rows: seed SFT_SEED (calculator.py says why).
Everything is built offline and seeded: running it twice gives the same model on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from make_chat_model import CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START, qwen2_bpe, save
from make_tiny_model import build_model, train_with_rl_sft
from tokenizers import Tokenizer, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from tasks.calculator import EVAL_SEED, EVAL_ROWS, SFT_SEED, Calculator, rows
from tasks.calculator import sft_conversation as conversation
from orchestrator.rollout.tool_parsers import HermesParser, ToolCall
from orchestrator.rollout.tool_functions import Tool, ToolError

TOOLS = {t.name: t for t in map(Tool.from_function, Calculator.tools)}
SCHEMAS = [t.schema for t in TOOLS.values()]
MAX_TURNS = 3          # the RL config's orchestrator.environment.max_turns
MAX_TURN_TOKENS = 64   # its max_tokens: a call turn takes at most 47 tokens with <|im_end|>
SEQ_LEN = 256          # its seq_len: a whole tool episode takes at most 207 (prompt <= 135)
MAX_MODEL_LEN = 512    # max_position_embeddings and the tokenizer's model_max_length
TOOL_TIMEOUT_S = 10.0
SAMPLES = 4            # episodes sampled per held-out row when measuring at T=1


# --- tokenizer -------------------------------------------------------------------------------

def fixed_texts() -> list[str]:
    """The text every episode shares: a conversation of one-digit numbers rendered by the
    template, cut at its special tokens (and between two newlines). Qwen2's split regex puts
    every digit in a piece of its own, so the BPE learns merges from the fixed text only (the
    tools header, the roles, the call's JSON skeleton, the tool-response tags, "Calculate"),
    never from an expression's digits and operators."""
    row = {"prompt": "Calculate 1.", "answer": "1", "metadata": {"expression": "1"}}
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    text = env.from_string(CHAT_TEMPLATE).render(
        messages=conversation(row), tools=SCHEMAS, add_generation_prompt=False)
    # Cut between the two "\n" of "assistant\n\n<tool_call>" too: a learnt "\n\n" token would
    # take the "\n" ending the generation prompt into the call's first token, so the ids trained
    # on would not extend the prompt the model is given (check_tokenizer checks that they do).
    return [t for t in re.split("|".join(map(re.escape, (ENDOFTEXT, IM_START, IM_END))) + r"|(?<=\n)(?=\n)", text) if t]


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """make_chat_model.py's recipe (a byte-level BPE set up as transformers' Qwen2Tokenizer), its
    merges learnt from `fixed_texts()`: each of their words becomes one token, while digits,
    operators and spaces stay one token each."""
    tok = qwen2_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,  # never reached: merging stops once each training word is one token
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes, no <unk>
        show_progress=False,
    )
    tok.train_from_iterator(fixed_texts(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_MODEL_LEN,
    )


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=SCHEMAS, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --- episodes --------------------------------------------------------------------------------

@torch.no_grad()
def hf_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sample: bool) -> list[list[int]]:
    """One turn per prompt, generated in a left-padded batch until <|im_end|> or <|endoftext|>
    (kept, as vLLM's token_ids keep it) or max_new_tokens; greedy, or sampled at T=1 (no top-k)
    from torch's global generator."""
    model.eval()
    stops = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    pad = stops[1]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         eos_token_id=stops, pad_token_id=pad, **sampling)
    model.train()
    turns = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        turns.append(row[:end])
    return turns


@dataclass
class Episode:
    row: dict
    ids: list[int]
    messages: list[dict]
    done: bool = False
    turns: int = 0
    calls: int = 0
    tool_errors: int = 0
    first_call: dict | None = None    # the first turn's first well-formed call to calculate
    truncated: bool = False
    reward: float = 0.0
    turn_lengths: list[int] = field(default_factory=list)


async def answer(call) -> tuple[str, bool]:
    """As orchestrator/rollout/tool_episode.py answers a call: (the tool message's text, failed)."""
    if not isinstance(call, ToolCall):
        return f"error: {call.error}", True
    tool = TOOLS.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}; the tools are {', '.join(TOOLS)}", True
    try:
        return await tool.call(call.arguments, TOOL_TIMEOUT_S), False
    except ToolError as e:
        return f"error: {e}", True


def play(generate, tokenizer, data: list[dict], sample: bool) -> list[Episode]:
    """Episodes of the rows, played as orchestrator/rollout/tool_episode.py plays them (the trajectory
    is appended to, never re-rendered); `generate(prompts, max_new_tokens, sample)` gives a
    turn's ids per prompt, ending with the stop token unless cut at max_new_tokens."""
    parser, im_end = HermesParser(), tokenizer.convert_tokens_to_ids(IM_END)
    stops = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    env = Calculator()
    episodes = []
    for row in data:
        messages = [{"role": "user", "content": row["prompt"]}]
        episodes.append(Episode(row, encode(tokenizer, render(tokenizer, messages, True)), messages))
    for turn in range(MAX_TURNS):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        for e, out in zip(active, generate([e.ids for e in active], MAX_TURN_TOKENS, sample)):
            out = out[:SEQ_LEN - len(e.ids)]  # the orchestrator's max_tokens leaves seq_len room
            e.ids, e.turns = e.ids + out, e.turns + 1
            e.turn_lengths.append(len(out))
            content, calls = parser.parse(tokenizer.decode(out, skip_special_tokens=True))
            message = {"role": "assistant", "content": content}
            good = [c for c in calls if isinstance(c, ToolCall)]
            if good:
                message["tool_calls"] = [{"id": f"call_{turn}_{i}", "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}}
                                         for i, c in enumerate(good)]
            e.messages.append(message)
            first = good[0] if turn == 0 and good else None
            if first and first.name == "calculate" and TOOLS["calculate"].argument_error(first.arguments) is None:
                e.first_call = first.arguments
            e.truncated = not out or out[-1] not in stops  # cut at max_tokens (or seq_len)
            if not calls or e.truncated or turn == MAX_TURNS - 1:
                e.done = True
                continue
            results = [asyncio.run(answer(c)) for c in calls]
            replies = [{"role": "tool", "tool_call_id": f"call_{turn}_{i}",
                        "name": c.name if isinstance(c, ToolCall) else "", "content": text}
                       for i, (c, (text, _)) in enumerate(zip(calls, results))]
            e.calls += len(calls)
            e.tool_errors += sum(failed for _, failed in results)
            before = render(tokenizer, e.messages, False)
            after = render(tokenizer, e.messages + replies, True)
            assert after.startswith(before)
            closing = before[before.rfind(IM_END) + len(IM_END):]
            if out[-1:] != [im_end]:
                closing = IM_END + closing
            between = encode(tokenizer, closing + after[len(before):])
            if len(e.ids) + len(between) >= SEQ_LEN:
                e.done = True
                continue
            e.messages += replies
            e.ids = e.ids + between
    for e in episodes:
        e.reward = env.reward(e.messages, e.row)
    return episodes


def summary(episodes: list[Episode]) -> dict[str, float]:
    n = len(episodes)
    return {
        "call": sum(e.first_call is not None for e in episodes) / n,   # a well-formed call first
        "exact_call": sum(e.first_call == {"expression": e.row["metadata"]["expression"]} for e in episodes) / n,
        "right": sum(e.reward == 1.0 for e in episodes) / n,           # the exact final answer
        "right_with_call": sum(e.reward == 1.0 and e.first_call is not None for e in episodes) / n,
        "reward": sum(e.reward for e in episodes) / n,
        "tool_errors": sum(e.tool_errors for e in episodes) / n,
        "truncated": sum(e.truncated for e in episodes) / n,
        "max_tokens": max(len(e.ids) for e in episodes),
    }


def show(name: str, s: dict[str, float]) -> str:
    return (f"{name}: well-formed call {s['call']:.2f} (exact expression {s['exact_call']:.2f}), right answer "
            f"{s['right']:.2f} ({s['right_with_call']:.2f} after a call), mean reward {s['reward']:.3f}, "
            f"tool errors/episode {s['tool_errors']:.2f}, truncated {s['truncated']:.2f}, "
            f"longest {s['max_tokens']} tokens")


# --- checks ----------------------------------------------------------------------------------

def check_tokenizer(out: Path, data: list[dict]) -> None:
    """The saved tokenizer, as AutoTokenizer loads it (the trainer) and tokenizer.json alone (the
    orchestrator), encodes every SFT conversation alike, and the ids of the conversation so far
    with the generation prompt are a prefix of the whole one's at each assistant turn: what the
    model is given to generate from is what it was trained on, token for token."""
    saved = AutoTokenizer.from_pretrained(out)
    rust = Tokenizer.from_file(str(out / "tokenizer.json"))
    for row in data:
        for messages in (conversation(row), conversation(row, direct=True)):
            ids = saved.apply_chat_template(messages, tools=SCHEMAS, return_dict=False)
            assert rust.encode(render(saved, messages, False), add_special_tokens=False).ids == ids, messages
            for k, message in enumerate(messages):
                if message["role"] == "assistant":
                    prompt = encode(saved, render(saved, messages[:k], True))
                    assert ids[:len(prompt)] == prompt, (messages, k)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and not (out / "chat_template.jinja").exists()
    print(f"tokenizer: AutoTokenizer and tokenizer.json give the same ids, generation prompts their "
          f"prefixes, on {2 * len(data)} conversations")


def report(out: Path, tokenizer, data: list[dict]) -> None:
    print(f"vocab {len(tokenizer)}; special ids: " + ", ".join(
        f"{t}={tokenizer.convert_tokens_to_ids(t)}" for t in (ENDOFTEXT, IM_START, IM_END)))
    print("files: " + ", ".join(f"{f.name} {f.stat().st_size}" for f in sorted(out.iterdir())))
    prompts = [len(encode(tokenizer, render(tokenizer, conversation(r)[:1], True))) for r in data]
    whole = [len(encode(tokenizer, render(tokenizer, conversation(r), False))) for r in data]
    calls = []
    for r in data:
        messages = conversation(r)
        start = len(encode(tokenizer, render(tokenizer, messages[:1], True)))
        calls.append(len(encode(tokenizer, render(tokenizer, messages[:2], False))) - start - 1)  # - the "\n"
    print(f"tokens over {len(data)} rows (max / mean): prompt {max(prompts)} / {sum(prompts) / len(data):.1f}; "
          f"call turn incl. <|im_end|> {max(calls)} / {sum(calls) / len(data):.1f}; "
          f"whole tool episode {max(whole)} / {sum(whole) / len(data):.1f}")
    ids = encode(tokenizer, render(tokenizer, conversation(data[0]), False))
    print(f"e.g. {len(ids)} tokens: {tokenizer.convert_ids_to_tokens(ids)}")


def check_vllm(out: Path, tokenizer, data: list[dict], hf: list[Episode]) -> None:
    """The same held-out episodes played greedily by vLLM: turns should stop at <|im_end|> (from
    generation_config.json) and score about as HF's do (fp32 kernels differ slightly)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # On CPU, gpu_memory_utilization is the share of the machine's memory the engine may claim:
    # it refuses to start when other programs hold more than the rest. The KV cache needs 1 GiB.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=SEQ_LEN, seed=0,
              gpu_memory_utilization=0.2)

    def generate(prompts, max_new_tokens, sample):
        params = [SamplingParams(temperature=1.0 if sample else 0.0, max_tokens=min(max_new_tokens, SEQ_LEN - len(p)))
                  for p in prompts]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    episodes = play(generate, tokenizer, data, sample=False)
    same = sum(a.ids == b.ids for a, b in zip(episodes, hf))
    print(show("vLLM greedy", summary(episodes)) + f"; same episode ids as HF: {same}/{len(data)}")
    sampled = play(generate, tokenizer, data * SAMPLES, sample=True)
    print(show(f"vLLM sampled (T=1, {SAMPLES} per row)", summary(sampled)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny-tool"))
    ap.add_argument("--init", type=Path, default=Path("models/tiny-tool-init"), help="the untrained model")
    ap.add_argument("--config", type=Path, default=Path("configs/sft_tiny_tool.toml"))
    ap.add_argument("--run", type=Path, default=Path("runs/sft_tiny_tool"), help="rl sft's output_dir")
    ap.add_argument("--seed", type=int, default=1234, help="the untrained model's weights, the sampled episodes")
    ap.add_argument("--check-vllm", action="store_true", help="also play the held-out episodes in vLLM")
    args, extra = ap.parse_known_args()  # the rest goes to rl sft (--max_steps 1500, ...)

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    tokenizer = build_tool_tokenizer()
    model = build_model(tokenizer, "tiny")
    model.config.bos_token_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)  # as Qwen2.5's config
    model.config.max_position_embeddings = MAX_MODEL_LEN  # default RoPE: no weights depend on it
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M, vocab {len(tokenizer)}")
    held_out = rows(EVAL_SEED, EVAL_ROWS)
    save(model, tokenizer, args.init)
    check_tokenizer(args.init, held_out + rows(SFT_SEED, 200))

    sft_start = time.perf_counter()
    weights = train_with_rl_sft(args.init, args.out, args.config, args.run, extra)
    print(f"rl sft: {time.perf_counter() - sft_start:.1f} s; {weights} -> {args.out}")
    trained = AutoModelForCausalLM.from_pretrained(args.out)

    def gen(prompts, max_new_tokens, sample):
        return hf_generate(trained, tokenizer, prompts, max_new_tokens, sample)

    greedy = play(gen, tokenizer, held_out, sample=False)
    print(f"saved {args.out}; held-out episodes ({len(held_out)} rows):")
    print(show("  greedy", summary(greedy)))
    torch.manual_seed(args.seed)
    sampled = summary(play(gen, tokenizer, held_out * SAMPLES, sample=True))
    print(show(f"  sampled (T=1, {SAMPLES} per row)", sampled))
    for e in greedy[:3]:
        print(f"  e.g. {tokenizer.decode(e.ids[len(encode(tokenizer, render(tokenizer, e.messages[:1], True))):])!r} "
              f"(answer {e.row['answer']}, reward {e.reward})")
    report(args.out, tokenizer, held_out + rows(0, 2000))  # + RL rows, for the longest
    print(f"built in {time.perf_counter() - start:.0f} s")
    if args.check_vllm:
        check_vllm(args.out, tokenizer, held_out, greedy)


if __name__ == "__main__":
    main()
