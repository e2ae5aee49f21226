"""The GPU check's items that run the programs as a user does (scripts/gpu_check.py): the
environment, trainer steps on 1 and N ranks, `rl run` with LoRA and with full fine-tuning; and what
every item shares (its context, config writing, logs, the metrics it reads)."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Scale:
    """The sizes an item runs at: a real model on a GPU, or a tiny one on a few cores."""
    trainer_dtype: str
    inference_dtype: str
    seq_len: int
    prompt_len: int
    completion_len: int
    samples: int
    prompts_per_step: int
    group_size: int
    max_tokens: int
    lr: float
    lora_lr: float
    gpu_memory_utilization: float | None


# GPU: configs/qwen_math_gpu.toml's shape, smaller; vLLM takes a third of the GPU because the
# trainer shares it in `rl run`. CPU: what the tests run the tiny models at.
GPU_SCALE = Scale("bfloat16", "bfloat16", 1024, 128, 256, 32, 8, 8, 128, 1e-6, 1e-5, 0.35)
CPU_SCALE = Scale("float32", "float32", 128, 8, 24, 8, 4, 4, 16, 1e-4, 2e-3, None)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


class CheckFailed(Exception):
    """The item failed; the message is the one line the report shows, `log` the file to read."""

    def __init__(self, message: str, log: Path | str = ""):
        super().__init__(message)
        self.log = str(log)


@dataclass
class Context:
    model: str
    dir: str
    ports: list[int]
    cuda: int
    """CUDA devices torch sees (0: the CPU paths)."""
    visible: list[str]
    ranks: int
    """trainer-N's ranks."""

    @property
    def gpu(self) -> bool:
        return self.cuda > 0

    @property
    def scale(self) -> Scale:
        return GPU_SCALE if self.gpu else CPU_SCALE

    @property
    def path(self) -> Path:
        return Path(self.dir)

    @property
    def model_config(self) -> dict:
        cfg = json.loads((Path(self.model) / "config.json").read_text())
        return {**cfg, **cfg.get("text_config", {})}  # multimodal configs nest the language model's

    @property
    def seq_len(self) -> int:
        return min(self.scale.seq_len, int(self.model_config.get("max_position_embeddings", self.scale.seq_len)))

    @property
    def tied(self) -> bool:
        return bool(self.model_config.get("tie_word_embeddings", False))

    def gpu_env(self, first: int = 0, count: int = 1) -> dict:
        """The environment for a program that should use visible GPUs first..first+count-1."""
        if not self.gpu:
            return dict(os.environ)
        return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(self.visible[first:first + count])}


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


NOISE = re.compile(r"^nanobind: |leaked|resource_tracker|^\s*$")


def last_line(log: Path) -> str:
    """The line of a log that most likely says why it failed: the last error line, else the last one."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines()[-60:] if not NOISE.search(ln)]
    except OSError:
        return f"(no log at {log})"
    errors = [ln for ln in lines if re.search(r"Error|error:|exited with code|refused|failed", ln)]
    return ((errors or lines or ["(empty log)"])[-1]).strip()[:300]


def merged(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def write_config(path: Path, ctx: Context, root: Path, extra: dict, port: int | None = None,
                 model: str | None = None) -> Path:
    """One config for the three programs, at the item's scale; `extra` is merged over it."""
    import tomli_w

    s = ctx.scale
    inference = {"dtype": s.inference_dtype, **({"port": port} if port else {})}
    if s.gpu_memory_utilization:
        inference["gpu_memory_utilization"] = s.gpu_memory_utilization
    trainer = {"model": {"dtype": s.trainer_dtype}, **({} if ctx.gpu else {"torch_threads": 1})}
    doc = {"model": model or ctx.model, "output_dir": str(root), "seq_len": ctx.seq_len, "seed": 0,
           "inference": inference, "trainer": trainer}
    path.write_text(tomli_w.dumps(merged(doc, extra)))
    return path


def run_logged(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> int:
    with open(log, "ab") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=env, cwd=cwd).returncode


def records(root: Path, program: str) -> list[dict]:
    """metrics.jsonl's records of `program`, in the order written."""
    from rl.rundir import RunDir

    path = RunDir(root).metrics
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("program") == program]


# --- environment -----------------------------------------------------------------------------


def check_environment(ctx: Context) -> tuple[str, dict]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise CheckFailed(f"torch does not import: {first_line(e)}") from None
    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "nccl": dist.is_nccl_available(), "devices": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            facts["devices"].append({"name": props.name, "memory_mib": props.total_memory // 2**20})
    try:
        import vllm
    except Exception as e:  # a broken install raises anything: the one line says what
        raise CheckFailed(f"vLLM does not import: {first_line(e)}") from None
    facts["vllm"] = vllm.__version__
    facts["transformers"] = package_version("transformers")
    facts["flash_attn"] = package_version("flash-attn") or package_version("flash_attn")
    devices = ", ".join(f"{d['name']} {d['memory_mib'] / 1024:.0f} GiB" for d in facts["devices"])
    note = (f"torch {facts['torch']}, " + (f"CUDA {facts['cuda']}: {devices}" if devices else "no CUDA: CPU items run")
            + f", NCCL {'yes' if facts['nccl'] else 'no'}, vLLM {facts['vllm']}, transformers {facts['transformers']}"
            + f", flash-attn {facts['flash_attn'] or 'no'}")
    return note, facts


# --- trainer-1, trainer-N ------------------------------------------------------------------------


def write_synthetic_batch(ctx: Context, root: Path) -> None:
    """Batch 1 as the orchestrator's file transport writes it: random token ids within the
    vocabulary, a prompt (context only) and a completion (trained on) with uniform logprobs
    (what a model that knows nothing would have sampled with), version 0 and +-1 advantages."""
    from rl.batch import Batch, Sample
    from rl.rundir import RunDir

    s, vocab = ctx.scale, int(ctx.model_config["vocab_size"])
    rng = random.Random(0)
    samples = []
    for i in range(s.samples):
        p, c = s.prompt_len, s.completion_len - 2 * (i % 4)  # lengths differ: packing and balancing work
        tokens = [rng.randrange(vocab) for _ in range(p + c)]
        advantage = 1.0 if i % 2 == 0 else -1.0
        samples.append(Sample(tokens, [0] * p + [1] * c, [0.0] * p + [-math.log(vocab)] * c,
                              [0.0] * p + [advantage] * c, [-1] * p + [0] * c, reward=(advantage + 1) / 2))
    Batch.write_encoded(*Batch.from_samples(1, samples).encode(), RunDir(root).rollout_dir(1))


def trainer_command(ctx: Context, ranks: int) -> tuple[list[str], dict]:
    """`rl trainer`, or torchrun as README.md says, with the environment (the GPUs) it gets."""
    env = ctx.gpu_env(0, ranks if ctx.gpu else 1)
    if not ctx.gpu:
        env["OMP_NUM_THREADS"] = "1"  # one thread per rank on a few cores (torchrun would say so)
    if ranks == 1:
        return [sys.executable, "-m", "asyncrl", "trainer"], env
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-port", str(ctx.ports[0]), "-m", "trainer"], env


def check_trainer(ctx: Context, ranks: int, extra: dict | None = None) -> tuple[str, dict]:
    """`extra`: config on top (context-N: trainer.parallel.context)."""
    from rl.rundir import STABLE, RunDir

    run = RunDir(ctx.path / "run")
    write_synthetic_batch(ctx, run.root)
    cfg = write_config(ctx.path / "trainer.toml", ctx, run.root, {"max_steps": 1, **(extra or {})})
    cmd, env = trainer_command(ctx, ranks)
    log = ctx.path / "trainer.log"
    rc = run_logged(cmd + ["@", str(cfg), "--max_steps", "1"], log, env)
    if rc != 0:
        raise CheckFailed(f"trainer exited {rc}: {last_line(log)}", log)
    if not (run.weights_dir(1) / STABLE).exists():
        raise CheckFailed("the trainer exited 0 but weights/step_1/STABLE is missing", log)
    mine = [r for r in records(run.root, "trainer") if r.get("step") == 1]
    if not mine or not math.isfinite(mine[-1].get("loss", math.nan)):
        raise CheckFailed(f"no finite loss in the trainer's step-1 record: {mine[-1:] or 'no record'}", log)
    r = mine[-1]
    backend = "NCCL" if ctx.gpu else "gloo"
    note = (f"step_s {r['step_s']:.2f}, loss {r['loss']:.4g}, {ctx.scale.trainer_dtype}, {ranks} rank(s) {backend}, "
            f"{r.get('trainer_tokens_per_s', 0):.0f} tok/s")
    return note, {k: r[k] for k in ("step_s", "loss", "write_s", "trainer_tokens_per_s") if k in r}


MOE_MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-moe"
EXPERT_RANKS = 2  # tiny-moe's 4 experts per layer over 2 ranks; expert parallelism spans every rank


def check_expert(ctx: Context) -> tuple[str, dict]:
    """expert-N: check_trainer's step on the project's tiny Qwen3-MoE with its experts split over
    2 GPUs (all-to-all dispatch over NCCL, whatever --gpus says: the expert group is the world)."""
    moe = replace(ctx, model=str(MOE_MODEL))
    return check_trainer(moe, EXPERT_RANKS, {"trainer": {"parallel": {"expert": EXPERT_RANKS}}})


# --- lora, run: `rl run` on a task the check writes ---------------------------------------------------


TASK_MODULE = '''"""The GPU check's task reward (scripts/gpu_check.py wrote this file)."""


def reward(prompt, completion, row):
    # The answer, and a little for length: a group's completions differ, so advantages do too.
    return float(row["answer"] in completion) + min(len(completion), 40) / 400
'''


def write_task(directory: Path) -> dict:
    """A jsonl of sums and a reward module beside the config: a dataset spec for [[orchestrator.datasets]]."""
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in
            [(2, 3), (4, 4), (1, 6), (5, 2), (3, 3), (7, 1), (2, 2), (6, 3)]]
    (directory / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "gpu_check_task.py").write_text(TASK_MODULE)
    return {"name": "sums", "path": str(directory / "sums.jsonl"), "reward": "gpu_check_task:reward"}


def rl_run(ctx: Context, steps: int, extra: dict) -> Path:
    """`rl run` of `steps` steps on the check's task; returns the run directory (exit 0 or CheckFailed)."""
    s, root, port = ctx.scale, ctx.path / "run", ctx.ports[0]
    orchestrator = {"scheduling": {"prompts_per_step": s.prompts_per_step, "group_size": s.group_size,
                                   "max_in_flight_groups": 2 * s.prompts_per_step},
                    "sampling": {"max_tokens": s.max_tokens}, "datasets": [write_task(ctx.path)]}
    base = {"max_steps": steps, "max_async_level": 1, "orchestrator": orchestrator,
            "trainer": {"optim": {"lr": s.lr}}}
    cfg = write_config(ctx.path / "run.toml", ctx, root, merged(base, extra), port=port)
    log = ctx.path / "rl_run.log"
    # The reward module lies beside the config: the programs import it from their directory.
    env = {**ctx.gpu_env(), "PYTHONPATH": os.pathsep.join([str(ctx.path), os.environ.get("PYTHONPATH", "")])}
    rc = run_logged([sys.executable, "-m", "asyncrl", "run", "@", str(cfg)], log, env=env, cwd=ctx.path)
    if rc != 0:
        raise CheckFailed(f"rl run exited {rc}: {last_line(log)}", log)
    for program in ("orchestrator", "trainer"):
        got = sorted({r["step"] for r in records(root, program)})
        if got != list(range(1, steps + 1)):
            raise CheckFailed(f"metrics.jsonl: {program} records for steps {got}, expected 1..{steps}", log)
    return root


def check_lora(ctx: Context) -> tuple[str, dict]:
    from rl.rundir import RunDir

    steps = 2
    root = rl_run(ctx, steps, {"inference": {"max_loras": 4}, "trainer": {"lora": {"rank": 8, "alpha": 16},
                                                                           "optim": {"lr": ctx.scale.lora_lr}}})
    run = RunDir(root)
    if not (run.weights_dir(steps) / "adapter_model.safetensors").exists():
        raise CheckFailed(f"weights/step_{steps} holds no adapter_model.safetensors", run.logs / "trainer.log")
    # metrics.jsonl's serving_version is taken when a batch is handed over (at most steps - 1
    # here); the orchestrator loads the final version before it stops and logs it.
    log = run.logs / "orchestrator.log"
    text = log.read_text(errors="replace")
    served = re.findall(r"version (\d+) \(adapter (\S+)\) serving on \d+ server\(s\) \(load ([\d.]+) s\)", text)
    # The final version's own load line may not come: the orchestrator records a server as serving
    # it as soon as its load answers and may stop before the delivery logs it (seen once); its
    # last line then says which version serves.
    done = re.findall(r"done: \d+ batches; version (\d+) serving", text)
    final = int(done[-1]) if done else int(served[-1][0]) if served else None
    if not served or final != steps:
        raise CheckFailed(f"the orchestrator never served adapter version {steps} (last: {served[-1:] or 'none'}, "
                          f"final: {final})", log)
    loads = [float(x) for _, _, x in served]
    note = f"adapters v1..v{steps} published, v{final} served at the end, load {max(loads):.2f} s max"
    return note, {"adapter_load_s": loads, "serving_version": final}


def check_run(ctx: Context) -> tuple[str, dict]:
    steps = 3
    root = rl_run(ctx, steps, {})
    trainer, orchestrator = records(root, "trainer"), records(root, "orchestrator")
    times = sorted(r["time"] for r in trainer)
    s_per_step = (times[-1] - times[0]) / (len(times) - 1)
    # Step 1's interval holds the server's start, and its groups run on into step 2's: the steps
    # after the first say what generation runs at.
    later = [r["tokens_per_s"] for r in orchestrator if r["step"] > 1]
    tokens_per_s = sum(later) / len(later)
    rewards = [r["reward_mean"] for r in sorted(orchestrator, key=lambda r: r["step"])]
    note = (f"{steps} steps: {s_per_step:.2f} s/step (after step 1), "
            f"{tokens_per_s:.0f} tok/s (orchestrator, steps 2-{steps}), "
            f"reward {rewards[0]:.2f} -> {rewards[-1]:.2f}")
    return note, {"s_per_step": s_per_step, "tokens_per_s": tokens_per_s, "rewards": rewards}
