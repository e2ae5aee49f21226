"""The rollout station: from one prompt to one scored group of samples (groups.py). The interface is
kind.py (a run's rollout kind, chosen once at start-up by registry.py from the config): single_turn.py
(datasets), text_environment.py, tool_environment.py (one episode: tool_episode.py; tools described by
tool_functions.py, calls read by tool_parsers.py), agent_environment.py (an external agent through
agent_endpoint.py) and verifiers_taskset.py; environment_base.py is what the environment kinds share,
environment.py the protocol a user's environment class follows. advantages.py turns a group's rewards
into advantages. A kind takes a prompt's row (orchestrator/prompts/), renders it
(orchestrator/rendering/), has it generated through the `generate` the scheduler hands in and scores
it (orchestrator/rewards/). A new kind: a file and a line in registry.py."""

# The station's interface, as the scheduling loop (orchestrator.py) and the stations above use it.
from orchestrator.rollout.groups import Group, Rollouts
from orchestrator.rollout.kind import Aborted, RolloutKind
from orchestrator.rollout.registry import kind_of

__all__ = ["Aborted", "Group", "RolloutKind", "Rollouts", "kind_of"]
