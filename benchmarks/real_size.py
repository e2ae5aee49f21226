"""The whole loop at real size on CPU: a Qwen2.5-0.5B-shaped model (scripts/make_real_size_model.py)
through `rl run` as a user starts it, a few steps per scenario, measured per program.

    python benchmarks/real_size.py                          # every scenario, 24 layers
    python benchmarks/real_size.py --layers 2 --steps 2     # the same shape, 2 layers (minutes)
    python benchmarks/real_size.py --scenario full-files --scenario lora

Scenarios (each a fresh run directory under runs/real_size/):
  full-files    chat dataset (1-2k-token prompts, 512-token completions), full fine-tuning,
                weights through files, held-out eval at the start and the end
  full-broadcast  the same, weights streamed to the server's worker (gloo on CPU)
  lora          the same data, LoRA adapters (rank 16, attention and MLP)
  tools         a tool environment whose system prompt carries several tools' JSON schemas
  eval          `rl eval` of the first scenario's published weights (one server start, reload)

Per program (its process and everything it started): wall time of the run, peak memory (PSS,
sampled every 0.25 s, summed over the program's processes), CPU seconds.
From metrics.jsonl: the trainer's step and weight-write times, the orchestrator's waits and
tokens/s. From the run directory: bytes per step of batches, weights and checkpoints. Batch
encode/decode timed in this process on the run's own last batch. Orchestrator CPU per sample is
its CPU seconds over the samples it generated (training and eval). Results go to
benchmarks/results/real_size_<layers>l.json; docs/performance.md "Real size" reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from process_tree import Sampler, process_stat, process_tree, children_of

ROOT = Path(__file__).resolve().parents[1]
RL = [sys.executable, "-m", "asyncrl"]  # the venv's rl, wherever its console script lives
OUT = ROOT / "runs" / "real_size"
SCENARIOS = ["full-files", "full-broadcast", "lora", "tools", "eval"]

# A task module the orchestrator imports from the run's working directory: long chat prompts (a
# document, then a question about it) and a cheap reward with some spread, so groups have
# advantages and the trainer does its whole step. Random weights never answer well: what is
# measured is the machinery, not learning.
TASK = '''
def reward(prompt, completion, row):
    words = set(completion.lower().split())
    return sum(w in words for w in row["keywords"]) / len(row["keywords"]) + 0.01 * len(completion) ** 0.5
'''

WORDS = ("model policy reward batch token weight server engine group sample trainer gradient "
         "version prompt rollout update buffer kernel memory tensor cache shard expert router "
         "answer question document chapter river mountain city harbour lantern garden winter").split()


def write_data(path: Path, tokenizer_file: Path, rows: int, lo: int, hi: int, seed: int) -> list[int]:
    """Chat rows whose user message is lo..hi tokens (the project's tokenizer counts them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    rng = random.Random(seed)
    lengths = []
    with path.open("w") as f:
        for i in range(rows):
            target = rng.randint(lo, hi)
            words = [rng.choice(WORDS) for _ in range(target)]
            text = " ".join(words)
            while len(tok.encode(text).ids) > target:  # trim to the target
                words = words[: int(len(words) * 0.95)]
                text = " ".join(words)
            keywords = rng.sample(WORDS, 4)
            prompt = f"Read this document.\n\n{text}\n\nWhich of these words does it use most: {', '.join(keywords)}?"
            lengths.append(len(tok.encode(prompt).ids))
            f.write(json.dumps({"prompt": prompt, "keywords": keywords}) + "\n")
    return lengths


def config(model: Path, scenario: str, args, seq_len: int) -> str:
    """The scenario's TOML (a user's config: every key named here is documented in --help)."""
    steps = args.steps
    lines = [f'model = "{model}"', f"max_steps = {steps}", f"seq_len = {seq_len}", "max_async_level = 1",
             "seed = 0", "", "[inference]", f"port = {args.port}", 'dtype = "bfloat16"', "cpus = [0]",
             "cpu_kv_cache_gib = 2", "", "[orchestrator]", "cpus = [0]", f"scheduling.prompts_per_step = {args.prompts}",
             "scheduling.group_size = 2", f"scheduling.max_in_flight_groups = {2 * args.prompts}",
             f"sampling.max_tokens = {args.max_tokens}", "sampling.temperature = 1.0",
             "timeouts.request_s = 3600", "timeouts.weights_s = 7200"]
    if scenario == "tools":
        lines += ["", "[orchestrator.environment]", 'class = "real_size_tools:ManyTools"', "max_turns = 2", ""]
    else:
        lines += ["", "[[orchestrator.datasets]]", 'name = "long"', 'path = "train.jsonl"',
                  'reward = "real_size_task:reward"', "", "[orchestrator.eval]", "rows = 2", f"every = {steps}",
                  "", "[[orchestrator.eval.datasets]]", 'name = "heldout"', 'path = "eval.jsonl"',
                  'reward = "real_size_task:reward"', ""]
    lines += ["[checkpoints]", "every = 2", "keep = 100", "",
              "[trainer]", "cpus = [1]", f'model.dtype = "{args.trainer_dtype}"', "model.activation_checkpointing = true",
              "files.keep_rollouts = 100", "files.keep_weights = 100", "timeouts.batch_s = 7200"]
    if scenario == "lora":
        lines += ["", "[trainer.lora]", "rank = 16"]
    if scenario == "full-broadcast":
        lines += ["", "[weight_sync]", 'kind = "broadcast"', "", "[timeouts]", "broadcast_s = 1800"]
    return "\n".join(lines) + "\n"

# A tool environment with several tools' schemas in its system prompt, as agent tasks have them:
# each episode's opening already carries ~1k tokens of schemas before the user's question.
TOOLS_ENV = '''
import random


def search_documents(query: str, limit: int = 5) -> str:
    """Search the document store.

    Args:
        query: words to look for
        limit: most results to return
    """
    return f"{limit} results for {query!r}"


def read_file(path: str, start_line: int = 0, end_line: int = -1) -> str:
    """Read a file of the workspace.

    Args:
        path: the file, relative to the workspace
        start_line: first line to read
        end_line: last line to read (-1: the end)
    """
    return f"contents of {path}"


def run_python(code: str, timeout_s: float = 10.0) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: the program
        timeout_s: longest it may run
    """
    return "ok"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. "3*(4+5)"
    """
    return "42"


def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather of a city.

    Args:
        city: the city's name
        unit: celsius or fahrenheit
    """
    return f"sunny in {city}"


def send_email(to: str, subject: str, body: str) -> str:
    """Send an email.

    Args:
        to: the recipient's address
        subject: the subject line
        body: the message
    """
    return "sent"


class ManyTools:
    tools = [search_documents, read_file, run_python, calculate, get_weather, send_email]
    system_prompt = "You are a careful assistant. Use the tools when they help; answer briefly."

    def dataset(self, seed):
        rng = random.Random(seed)
        while True:
            city = rng.choice(["Oslo", "Lima", "Pune", "Kyoto"])
            yield {"prompt": f"What is the weather in {city}, and what is 17*23? Then email me both.", "city": city}

    def reward(self, messages, row):
        return float(row["city"] in (messages[-1].get("content") or ""))
'''


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def per_step_bytes(run: Path) -> dict:
    """Bytes of each step's batch, weights and checkpoint (mean over the steps present)."""
    out = {}
    for kind, pattern in (("batch", "rollouts/step_*"), ("weights", "weights/step_*"),
                          ("trainer_checkpoint", "checkpoints/step_*/trainer"),
                          ("orchestrator_checkpoint", "checkpoints/step_*/orchestrator")):
        sizes = [dir_bytes(p) for p in run.glob(pattern)]
        out[kind] = {"steps": len(sizes), "mean_bytes": sum(sizes) / len(sizes) if sizes else 0}
    return out


def batch_codec_s(run: Path) -> dict:
    """Decode then encode the run's last batch, in this process (the hand-over's own cost)."""
    sys.path.insert(0, str(ROOT / "src"))
    from rl.batch import Batch

    steps = sorted(run.glob("rollouts/step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not steps:
        return {}
    meta, payload = (steps[-1] / "meta.json").read_bytes(), (steps[-1] / "batch.safetensors").read_bytes()
    t0 = time.perf_counter()
    batch = Batch.decode(meta, payload, str(steps[-1]))
    t1 = time.perf_counter()
    batch.encode()
    t2 = time.perf_counter()
    return {"tokens": int(batch.tokens.size), "bytes": len(payload), "decode_s": t1 - t0, "encode_s": t2 - t1}


def summarize(records: list[dict]) -> dict:
    trainer = [r for r in records if r.get("program") == "trainer"]
    orch = [r for r in records if r.get("program") == "orchestrator"]
    evals = [r for r in records if r.get("program") == "eval"]

    def mean(rs, key):
        xs = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        return sum(xs) / len(xs) if xs else None

    later = [r for r in trainer if r["step"] > 1] or trainer  # step 1 carries the first compile/warm-up
    return {"trainer_steps": len(trainer), "trainer_step_s": mean(later, "step_s"),
            "trainer_step_s_first": trainer[0]["step_s"] if trainer else None,
            "trainer_write_s": mean(later, "write_s"), "trainer_wait_s": mean(later, "wait_s"),
            "trainer_checkpoint_s": mean([r for r in trainer if r.get("checkpoint_s")], "checkpoint_s"),
            "trainer_tokens": mean(trainer, "tokens"),
            "orchestrator_wait_s": mean(orch, "wait_s"), "generate_tokens_per_s": mean(orch, "tokens_per_s"),
            "eval_s": [r.get("eval_s") for r in evals], "reward_mean": mean(orch, "reward_mean")}


def run_scenario(name: str, model: Path, args) -> dict:
    run = OUT / name
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    tokenizer = model / "tokenizer.json"
    lengths = write_data(run / "train.jsonl", tokenizer, 16, args.prompt_min, args.prompt_max, seed=0)
    write_data(run / "eval.jsonl", tokenizer, 2, args.prompt_min, args.prompt_max, seed=1)
    (run / "real_size_task.py").write_text(TASK)
    (run / "real_size_tools.py").write_text(TOOLS_ENV)
    seq_len = args.prompt_max + 64 + args.max_tokens  # the chat template's tokens besides the prompt
    (run / "cfg.toml").write_text(config(model, name, args, seq_len))
    argv = [*RL, "run", "@", "cfg.toml", "--output_dir", str(run / "run")]
    print(f"[{name}] $ {' '.join(argv[2:])}  (prompts {min(lengths)}-{max(lengths)} tokens)", flush=True)
    start = time.perf_counter()
    with open(run / "rl_run.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=run, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sampler = Sampler(proc.pid)
        sampler.start()
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # rl run stops its three programs: the next scenario needs the port
            proc.wait(timeout=60)
            raise
        finally:
            sampler.stop.set()
            sampler.join()
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"[{name}] rl run exited {code}: see {run / 'rl_run.log'}")
    records = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    result = {"scenario": name, "wall_s": wall, "peak_pss_bytes": sampler.peak_pss, "cpu_s": sampler.cpu_s,
              "prompt_tokens": [min(lengths), max(lengths)], **summarize(records),
              "bytes_per_step": per_step_bytes(run / "run"), "batch_codec": batch_codec_s(run / "run")}
    # Samples generated: the batches' (prompts x 2 completions a step) and eval's (one greedy
    # completion per row); groups cancelled for staleness would add a few uncounted ones.
    evals = sum(r.get("eval/heldout/rows", 0) for r in records if r.get("program") == "eval")
    result["orchestrator_cpu_s_per_sample"] = sampler.cpu_s["orchestrator"] / (args.steps * args.prompts * 2 + evals)
    return result


def run_eval(args) -> dict:
    """`rl eval` of the full-files run's last published weights: its own server, one reload."""
    run = OUT / "full-files"
    if not (run / "run" / "weights" / f"step_{args.steps}").exists():
        print(f"real_size.py: --scenario eval evaluates the full-files scenario's weights/step_{args.steps}: "
              f"run --scenario full-files --steps {args.steps} first", file=sys.stderr)
        raise SystemExit(2)
    argv = [*RL, "eval", "@", "cfg.toml", "--output_dir", str(run / "run"), "--step", str(args.steps),
            "--inference.port", str(args.port)]
    print(f"[eval] $ {' '.join(argv[2:])}", flush=True)
    start = time.perf_counter()
    with open(OUT / "eval.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=run, stdout=log, stderr=subprocess.STDOUT)
        peak = 0  # rl eval and the server it starts, one process tree
        while proc.poll() is None:
            tree = process_tree(proc.pid, children_of())
            peak = max(peak, sum((process_stat(p) or (0, 0))[0] for p in tree))
            time.sleep(0.25)
    if proc.returncode != 0:
        raise RuntimeError(f"[eval] rl eval exited {proc.returncode}: see {OUT / 'eval.log'}")
    return {"scenario": "eval", "wall_s": time.perf_counter() - start, "peak_pss_bytes": {"eval": peak}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24, choices=[2, 24])
    ap.add_argument("--scenario", action="append", choices=SCENARIOS)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per step (2 completions each)")
    ap.add_argument("--trainer-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt-min", type=int, default=1024)
    ap.add_argument("--prompt-max", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--timeout-s", type=float, default=3 * 3600)
    ap.add_argument("--port", type=int, default=8390)
    args = ap.parse_args()
    model = ROOT / "models" / ("qwen-shape-0.5b" if args.layers == 24 else "qwen-shape-2l")
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_real_size_model.py"), "--layers", str(args.layers)],
                       check=True, cwd=ROOT)
    results_file = ROOT / "benchmarks" / "results" / f"real_size_{args.layers}l.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for name in args.scenario or SCENARIOS:
        result = run_eval(args) if name == "eval" else run_scenario(name, model, args)
        result.update(layers=args.layers, steps=args.steps, prompts=args.prompts, max_tokens=args.max_tokens,
                      trainer_dtype=args.trainer_dtype)
        results[name] = result
        results_file.write_text(json.dumps(results, indent=1) + "\n")  # after each: a long run keeps what it has
        print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
