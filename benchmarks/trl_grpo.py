"""TRL's synchronous GRPOTrainer on one of our tasks, as the baseline of benchmarks/vs_trl.py. Runs
in its own environment (.venv-trl: trl with torch pinned; vs_trl.py builds it), imports nothing of
asyncrl but the task (plain Python), and logs one JSON line per step: time, reward, lengths.

    .venv-trl/bin/python benchmarks/trl_grpo.py --model models/tiny-reverse --task reverse \
        --steps 300 --out runs/bench/trl.jsonl

The recipe mirrors an asyncrl config: `prompts` x `group_size` completions per optimizer step
(one generation per step: on-policy), temperature, lr, no KL (beta 0), clip 0.2/0.28, group-std
reward scaling, token-level loss normalisation (dapo). Generation is transformers' generate on
this CPU (TRL's vLLM modes need CUDA for weight sync).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="reverse",
                    help="reverse or count (orchestrator/tasks), or gym:<reasoning-gym task> (prompts as chat "
                         "messages through the model's template, reward 1 for full marks, as configs/demo.toml)")
    ap.add_argument("--task-config", type=json.loads, default={}, help="gym tasks: the task's settings (JSON)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads: the whole machine")
    ap.add_argument("--stop-at", type=float, default=None,
                    help="stop once the trailing-10 mean reward reaches this")
    ap.add_argument("--budget-s", type=float, default=None, help="stop this many seconds after launch")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    started = time.time()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    if args.task.startswith("gym:"):
        rows, reward = gym_task(args.task[4:], args.task_config, args.steps * args.prompts, args.seed)
    else:
        task = importlib.import_module(f"tasks.{args.task}")
        rows = list(itertools.islice(task.dataset(args.seed), args.steps * args.prompts))

        def reward(prompts, completions, answer, **_):
            return [task.reward(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]
    dataset = Dataset.from_list(rows)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = open(args.out, "w")
    log.write(json.dumps({"event": "start", "time": started}) + "\n")
    rewards: list[float] = []

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **_):
            if not logs or "reward" not in logs:
                return
            rewards.append(logs["reward"])
            log.write(json.dumps({"step": state.global_step, "time": time.time(), "reward": logs["reward"],
                                  "completion_length": logs.get("completions/mean_length")}) + "\n")
            log.flush()
            if args.stop_at is not None and len(rewards) >= 10 and sum(rewards[-10:]) / 10 >= args.stop_at:
                control.should_training_stop = True
            if args.budget_s is not None and time.time() - started >= args.budget_s:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=str(args.out.parent / f"{args.out.stem}_trainer"),
        per_device_train_batch_size=args.prompts * args.group_size,
        num_generations=args.group_size,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, scale_rewards="group", loss_type="dapo",
        num_iterations=1, max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, bf16=False, seed=args.seed, disable_tqdm=True, shuffle_dataset=False,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = model_tokenizer(args.model)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Record()])
    trainer.train()
    log.write(json.dumps({"event": "end", "time": time.time()}) + "\n")
    log.close()


def gym_task(name: str, task_config: dict, rows: int, seed: int):
    """A reasoning-gym task as conversational rows (TRL renders them with the model's chat
    template) and the reward configs/demo.toml gives: 1 when the task's scorer gives full marks."""
    import reasoning_gym

    data = reasoning_gym.create_dataset(name, size=rows, seed=seed, **task_config)
    entries = [data[i] for i in range(rows)]
    table = [{"prompt": [{"role": "user", "content": e["question"]}], "entry": json.dumps(e)} for e in entries]
    score = reasoning_gym.get_score_answer_fn(name)

    def reward(prompts, completions, entry, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(score(t.strip(), json.loads(e)) >= 1.0) for t, e in zip(texts, entry)]

    return table, reward


def model_tokenizer(model: str):
    """The model directory's tokenizer.json as it is. AutoTokenizer under transformers 5 rebuilds a
    tokenizer of a known model type from its class's recipe, which turns the char-level tiny
    models' tokenizer into a byte-level BPE (src/orchestrator/rendering/tokenizer.py): TRL would then train
    on other ids than the model was made with."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = json.loads((Path(model) / "tokenizer_config.json").read_text())
    fast = PreTrainedTokenizerFast(tokenizer_file=str(Path(model) / "tokenizer.json"),
                                   **{k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)})
    if config.get("chat_template"):
        fast.chat_template = config["chat_template"]
    reference = AutoTokenizer.from_pretrained(model)
    probe = "Reverse: hello, wörld 123"
    if reference(probe)["input_ids"] != fast(probe)["input_ids"]:
        print(f"{model}: AutoTokenizer gives other ids than tokenizer.json; using tokenizer.json", flush=True)
    return fast


if __name__ == "__main__":
    main()
