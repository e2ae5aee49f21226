"""Where a run's rows come from, whichever rollout kind plays them: the seeded mix of its datasets
(dataset_mix.py), or, with orchestrator.environment.class, that environment's dataset(seed). The
queue (queue.py) draws from it; the rollout station gets the environment it built and the
datasets' sources, and never hands rows back up.

The environment is built here, once, because its dataset is this station's row source; its
episodes are the rollout station's (orchestrator/rollout/environment_base.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from orchestrator.callables import load_callable
from orchestrator.prompts.dataset_mix import Source, configured_sources, mix
from rl.config import RunConfig


class Rows:
    def __init__(self, sources: dict[str, Source], env=None):
        """`sources`: the datasets by name (none with an environment); `env`: the built environment."""
        self.sources, self.env = sources, env

    @classmethod
    def for_run(cls, cfg: RunConfig) -> Rows:
        spec = cfg.orchestrator.environment
        env = load_callable(spec.class_, "orchestrator.environment.class")(**spec.args) if spec.class_ else None
        return cls({} if env else {s.name: s for s in configured_sources(cfg)}, env)

    def draws(self, seed: int) -> Iterator[tuple[str, object]]:
        """The run's stream of (dataset name, draw) for the queue (queue.py)."""
        if self.env is not None:
            return (("", row) for row in self.env.dataset(seed))
        return mix(list(self.sources.values()), seed)

    def fetch(self, source: str, draw) -> tuple[dict, str]:
        """A draw's (row, where it came from)."""
        if self.env is not None:
            return draw, "orchestrator.environment"
        return self.sources[source].fetch(draw)

