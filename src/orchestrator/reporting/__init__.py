"""The reporting station: what a person sees. batch_report.py writes one record per batch to
metrics.jsonl and one status line; tracking.py feeds wandb/TensorBoard from metrics.jsonl; streaks.py
stops a run that spins (one cause making every row or group come to nothing); quiet_warning.py says a
repeating warning at a bounded rate."""
