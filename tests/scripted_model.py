"""A model whose turns a test writes (ScriptedModel: turn t of every episode is script[t]), the
tiny chat model's tokenizer it writes with, and the run config of a tool environment around it:
the tool-episode and verifiers-taskset tests need turns no small model writes on cue."""

from __future__ import annotations

from tokenizers import Tokenizer

from conftest import ROOT
from rl.config import RunConfig
from rl.inference_api import GeneratedSample, GenerateRequest, GenerateResponse


CHAT_MODEL = ROOT / "models" / "tiny-chat"
TOKENIZER = Tokenizer.from_file(str(CHAT_MODEL / "tokenizer.json"))
IM_END = TOKENIZER.token_to_id("<|im_end|>")


# The scripted calls of `add` and `fail` run in a thread (orchestrator/rollout/tool_functions.py) and must answer within it
# on a loaded machine, where a thread may wait a while to be scheduled; `hang` (awaiting, far
# longer than any timeout) never does.
TOOL_TIMEOUT_S = 2


def config(env: str = "test_tool_episode:Tools", seq_len: int = 4096, max_turns: int = 4, args: dict | None = None,
           **orchestrator) -> RunConfig:
    """`env`, `args`, `max_turns`: [orchestrator.environment]'s; `orchestrator`: tables of
    [orchestrator] (sampling's keys join the defaults here)."""
    sampling = {"max_tokens": 200, **orchestrator.pop("sampling", {})}
    return RunConfig.model_validate({"model": str(CHAT_MODEL), "seq_len": seq_len, "orchestrator": {
        "environment": {"class": env, "max_turns": max_turns, "args": args or {}}, "scheduling": {"group_size": 2},
        "timeouts": {"tool_s": TOOL_TIMEOUT_S}, "sampling": sampling, **orchestrator}})


class ScriptedModel:
    """Writes turn t of every episode as SCRIPT[t] followed by <|im_end|>, and records what it was
    asked and what it answered."""

    def __init__(self, script: list[str]):
        self.script, self.calls = script, []

    async def __call__(self, request: GenerateRequest) -> GenerateResponse:
        turn = int(request.request_id.rsplit("-t", 1)[1])
        ids = TOKENIZER.encode(self.script[turn], add_special_tokens=False).ids + [IM_END]
        self.calls.append((request.request_id, list(request.prompt_token_ids), ids))
        sample = GeneratedSample(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[3] * len(ids),
                                 finish_reason="stop")
        return GenerateResponse(samples=[sample])
