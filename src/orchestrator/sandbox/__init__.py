"""The sandbox station: model-written code run isolated and bounded. sandbox.py is the interface
(Sandbox(Limits(...)).run(code) -> RunResult); beside it sandbox_limits.py (limits, rlimits),
sandbox_bwrap.py (bubblewrap's command line, seccomp, the probe), sandbox_users.py (user ids as
root), sandbox_cgroup.py (a run's total), sandbox_budget.py (runs at once within
orchestrator.sandbox.memory_mb), sandbox_supervise.py (output, clock, outcome). Rewards (a coding
task's tests) and tools (a python tool) use it; it uses no other station."""

# The station's interface, as the other stations and the tasks use it.
from orchestrator.sandbox.sandbox import OUTCOME_LISTENERS, SLOTS, Limits, RunResult, Sandbox
from orchestrator.sandbox.sandbox_budget import BUDGET

__all__ = ["BUDGET", "OUTCOME_LISTENERS", "SLOTS", "Limits", "RunResult", "Sandbox"]
