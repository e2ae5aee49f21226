"""The servers station: the inference servers as the orchestrator sees them. server.py is one server
(its client, version, load), pool.py the pool the scheduler sends groups to; delivery.py (the
interface: one class per weight_sync kind) brings each new weights version to every server;
trainer_watch.py says within seconds when the trainer is gone."""
