"""The run's config schema, one file per table (docs/config.md is generated from it):

    run.py                 RunConfig: shared keys, checks that span tables
    load.py                `@ a.toml --key value` -> RunConfig, ConfigError
    moved.py               keys that moved: one line naming their new place
    section.py             the base of every table
    inference.py           [inference]
    delivery.py            [transport], [weight_sync]
    trainer.py             [trainer] and its tables
    orchestrator.py        [orchestrator]
    orchestrator_tables.py   its servers, teacher, prompts, sampling, scheduling, timeouts
    rollout_tables.py        its environment, tools, sandbox, overlong, curriculum
    datasets.py            [[orchestrator.datasets]], [orchestrator.eval]
    sft.py                 [sft]
    launch.py              [slurm], [tracking]
    parallel_layout.py     [trainer.parallel] against the rank count
"""

from rl.config.datasets import Dataset, DatasetConfig, EvalConfig, Sampling
from rl.config.delivery import (
    BroadcastWeightSync, FilesTransport, FilesWeightSync, TransportConfig, WeightSyncConfig, ZmqTransport)
from rl.config.inference import InferenceConfig
from rl.config.launch import SlurmConfig, TrackingConfig
from rl.config.load import ConfigError, load_config, parse_args, to_toml_dict
from rl.config.orchestrator import OrchestratorConfig
from rl.config.run import RunConfig
from rl.config.section import Section
from rl.config.sft import SftConfig
from rl.config.trainer import LoRAConfig, LossConfig, OptimConfig, ParallelConfig, TrainerConfig

__all__ = [
    "BroadcastWeightSync", "ConfigError", "FilesTransport", "FilesWeightSync", "ZmqTransport", "Dataset", "DatasetConfig", "EvalConfig", "InferenceConfig", "LoRAConfig", "LossConfig",
    "OptimConfig", "OrchestratorConfig", "ParallelConfig", "RunConfig", "Sampling", "Section", "SftConfig",
    "SlurmConfig", "TrackingConfig", "TrainerConfig", "TransportConfig", "WeightSyncConfig", "load_config",
    "parse_args", "to_toml_dict",
]
