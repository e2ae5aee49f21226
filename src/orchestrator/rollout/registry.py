"""The registry of rollout kinds (orchestrator/rollout/kind.py): a new kind is a file with its
class and one line here. A run's kind follows from its config: without orchestrator.environment.class
its datasets; with one, the class it names is an external agent if it has `agent`, a tool
environment if it declares `tools`, else a text environment (the protocols in
orchestrator/rollout/environment.py)."""

from __future__ import annotations

from orchestrator.rollout.agent_environment import AgentEpisodes
from orchestrator.rollout.kind import RolloutKind
from orchestrator.rollout.single_turn import SingleTurn
from orchestrator.rollout.text_environment import TextEpisodes
from orchestrator.rollout.tool_environment import ToolEpisodes

KINDS: dict[str, type[RolloutKind]] = {
    "datasets": SingleTurn,
    "text": TextEpisodes,
    "tools": ToolEpisodes,
    "agent": AgentEpisodes,
}


def kind_of(env) -> type[RolloutKind]:
    """The kind for a run's built environment (None: no orchestrator.environment)."""
    if env is None:
        return KINDS["datasets"]
    return KINDS["agent" if hasattr(env, "agent") else "tools" if hasattr(env, "tools") else "text"]
