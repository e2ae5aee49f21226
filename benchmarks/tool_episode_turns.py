"""What a long tool episode costs the orchestrator, turn by turn, at real vocabulary size: a
scripted model (no server) calls a tool each turn on the Qwen-shaped tokenizer and ChatTemplate
(scripts/make_real_size_model.py), and the episode code that runs under `rl run`
(orchestrator/rollout/tool_episode.py: parse, run the tool, render the conversation twice to find the
ids between turns, encode them) is timed per turn, beside the bytes of the request the next
turn would send (the whole episode's ids so far, as JSON).

    .venv/bin/python benchmarks/tool_episode_turns.py [--turns 48] [--result-chars 2000]

The re-render is the one part that grows with the conversation (O(turns^2) for the episode);
this shows at what length it matters against a model turn. Results:
benchmarks/results/tool_episode_turns.json and docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tokenizers import Tokenizer  # noqa: E402

from orchestrator.rendering.chat import ChatTemplate  # noqa: E402
from orchestrator.rollout.tool_episode import ToolEpisode  # noqa: E402
from orchestrator.rollout.tool_parsers import tool_parser  # noqa: E402
from orchestrator.rollout.tool_functions import load_tools  # noqa: E402
from rl.inference_api import GeneratedSample  # noqa: E402

TOKENIZER = ROOT / "models" / "qwen-shape-tokenizer"
WORDS = "def class return import for while with yield lambda async await value index result".split()


def episode(turns: int, result_chars: int) -> list[dict]:
    """Per turn: ms outside the model's turn, context tokens after it, request bytes."""
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    template = ChatTemplate.load(TOKENIZER)

    def read_file(path: str) -> str:
        """Read a file of the workspace.

        Args:
            path: the file, relative to the workspace
        """
        return " ".join(WORDS[(i * 7 + len(path)) % len(WORDS)] for i in range(result_chars // 6))[:result_chars]

    class Workspace:
        tools = [read_file]
        system_prompt = "You are a careful assistant."

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    runner = ToolEpisode(Workspace(), load_tools(Workspace.tools, "Workspace"), template, tok, encode, decode,
                         tool_parser("hermes"), 10.0, turns, 1 << 30)
    rows: list[dict] = []
    clock = {"t": time.perf_counter()}

    async def sample_turn(request_id: str, tokens: list[int]) -> GeneratedSample:
        # Everything since the last model turn returned is the orchestrator's work for this turn.
        now = time.perf_counter()
        if rows:
            rows[-1]["orchestrator_ms"] = (now - clock["t"]) * 1e3
        rows.append({"turn": len(rows) + 1, "context_tokens": len(tokens),
                     "request_bytes": len(json.dumps(tokens))})
        call = json.dumps({"name": "read_file", "arguments": {"path": f"src/module_{len(rows)}.py"}})
        ids = encode(f"<tool_call>\n{call}\n</tool_call><|im_end|>", add_special_tokens=False)
        clock["t"] = time.perf_counter()
        return GeneratedSample(token_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason="stop")

    asyncio.run(runner.run({"prompt": "Read the workspace's modules one by one."}, "e", sample_turn,
                           lambda ids, sample=None: None))
    return [r for r in rows if "orchestrator_ms" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=48)
    ap.add_argument("--result-chars", type=int, default=2000, help="each tool result's length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tool_episode_turns.json")
    args = ap.parse_args()
    if not (TOKENIZER / "tokenizer.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_real_size_model.py"), "--layers", "2"],
                       check=True)
    runs = [episode(args.turns, args.result_chars) for _ in range(args.repeats)]
    table = []
    for i, row in enumerate(runs[0]):
        times = [r[i]["orchestrator_ms"] for r in runs]
        table.append({**row, "orchestrator_ms": round(statistics.median(times), 2),
                      "orchestrator_ms_spread": [round(min(times), 2), round(max(times), 2)]})
    total = [sum(r["orchestrator_ms"] for r in run) for run in runs]
    result = {"turns": args.turns, "result_chars": args.result_chars, "repeats": args.repeats,
              "episode_orchestrator_s": [round(t / 1e3, 3) for t in total], "per_turn": table}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in table:
        if row["turn"] in (1, 2, 4, 8, 16, 24, 32, 40) or row["turn"] == len(table):
            print(f"turn {row['turn']:3d}  context {row['context_tokens']:6d} tokens  request "
                  f"{row['request_bytes'] / 1e3:7.1f} KB  orchestrator {row['orchestrator_ms']:7.2f} ms "
                  f"({row['orchestrator_ms_spread'][0]:.2f}-{row['orchestrator_ms_spread'][1]:.2f})")
    print(f"episode of {len(table)} tool turns: orchestrator {', '.join(f'{t:.2f}' for t in result['episode_orchestrator_s'])} s")


if __name__ == "__main__":
    main()
