"""The reporting station: what a person sees. batch_report.py writes one record per batch to
metrics.jsonl and one status line; tracking.py feeds wandb/TensorBoard from metrics.jsonl and
the same records go to Prometheus (orchestrator.metrics_port). (The Prometheus metrics,
orchestrator/prometheus.py, the stop for a run that spins, orchestrator/streaks.py, and the
bounded-rate warning, orchestrator/quiet_warning.py, sit at the top: every station uses them.)"""

# The station's interface, as the scheduling loop (orchestrator.py) uses it.
from orchestrator.reporting.batch_report import Counters, Reporting

__all__ = ["Counters", "Reporting"]
