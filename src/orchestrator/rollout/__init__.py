"""The rollout station: from one prompt to one scored group of samples (groups.py). The interface is
kind.py (a run's rollout kind, chosen once at start-up by registry.py from the config): single_turn.py
(datasets), text_environment.py, tool_environment.py (one episode: tool_episode.py; tools described by
tool_functions.py, calls read by tool_parsers.py), agent_environment.py (an external agent through
agent_endpoint.py) and verifiers_taskset.py; environment_base.py is what the environment kinds share,
environment.py the protocol a user's environment class follows. advantages.py turns a group's rewards
into advantages; sandbox.py runs model-written code. A new kind: a file and a line in registry.py."""

# The station's interface, as the scheduling loop (orchestrator.py) uses it.
from orchestrator.rollout.groups import Group, Rollouts
from orchestrator.rollout.kind import Aborted

__all__ = ["Aborted", "Group", "Rollouts"]
