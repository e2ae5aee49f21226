"""The servers station: the inference servers as the orchestrator sees them. server.py is one server
(its client, version, load), pool.py the pool the scheduler sends groups to; delivery.py (the
interface: one class per weight_sync kind) brings each new weights version to every server,
weights_follower.py notices each version the trainer publishes; trainer_watch.py says within
seconds when the trainer is gone."""

# The station's interface, as the scheduling loop (orchestrator.py) uses it.
from orchestrator.servers.delivery import WeightDelivery
from orchestrator.servers.pool import ServerPool
from orchestrator.servers.server import Server
from orchestrator.servers.trainer_watch import watch_trainer
from orchestrator.servers.weights_follower import WeightsFollower

__all__ = ["Server", "ServerPool", "WeightDelivery", "WeightsFollower", "watch_trainer"]
