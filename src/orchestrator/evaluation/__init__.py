"""The evaluation station: held-out scores. held_out.py evaluates the eval datasets during a run,
environments.py the eval environments; command.py is `rl eval` over a finished run's weights."""

# The station's interface, as the scheduling loop (orchestrator.py) uses it.
from orchestrator.evaluation.held_out import EvaluationRunner

__all__ = ["EvaluationRunner"]
