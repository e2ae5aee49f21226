"""What an entry of the vLLM contract is (package docstring): a Use names one vLLM internal, what
kind of thing it is (how tests/inference/test_vllm_contract.py checks it), and the runners it must exist on.
"""

from __future__ import annotations

from dataclasses import dataclass

MODULE_ATTR = "module attribute"  # getattr(import_module(module), name): a function, class, constant
CLASS_ATTR = "class attribute"  # "Class.attr" is on the class: a method, property, enum member
INSTANCE_ATTR = "instance attribute"  # assigned to self.<attr> in the class (or a base), or a declared field
ENV = "env variable"  # a key of vllm.envs.environment_variables
CLI_FLAG = "CLI flag"  # an option of `vllm serve`'s parser (make_arg_parser); "--flag=value": value in its choices
SOURCE_TEXT = "source text"  # a literal the project relies on appears in the module's source
# "Type.attr": the module's source assigns `<something>.attr = ...` (or a class of it declares the
# field): an attribute vLLM puts on an object that is not its own class (a torch Parameter's
# weight_loader, a model's torchao flag), or a foreign config's field.
ASSIGNED_ATTR = "attribute vLLM assigns"
KINDS = (MODULE_ATTR, CLASS_ATTR, INSTANCE_ATTR, ENV, CLI_FLAG, SOURCE_TEXT, ASSIGNED_ATTR)

RUNNERS = ("v1", "v2", "both", "cpu")
# Placeholders for `module`: the entry is checked on each class RUNNER_CLASSES / WORKER_CLASSES
# give for its runners ("both": v1 and v2). GPU runners cannot be built on CPU, so instance
# attributes are read from the classes' source.
MODEL_RUNNER = "<model runner>"
WORKER = "<worker>"
V1_RUNNERS = ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "vllm.v1.worker.cpu_model_runner:CPUModelRunner")
V2_RUNNERS = ("vllm.v1.worker.gpu.model_runner:GPUModelRunner", "vllm.v1.worker.cpu.model_runner:CPUModelRunner")
RUNNER_CLASSES = {"v1": V1_RUNNERS, "v2": V2_RUNNERS, "both": V1_RUNNERS + V2_RUNNERS,
                  "cpu": ("vllm.v1.worker.cpu_model_runner:CPUModelRunner",)}
# One worker class builds either runner: the runner choice does not change the worker.
WORKERS = ("vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker")
WORKER_CLASSES = {"v1": WORKERS, "v2": WORKERS, "both": WORKERS, "cpu": ("vllm.v1.worker.cpu_worker:CPUWorker",)}


@dataclass(frozen=True)
class Use:
    module: str
    """Dotted vLLM module (MODEL_RUNNER / WORKER for those classes); for ENV "vllm.envs", for
    CLI_FLAG the module of make_arg_parser."""
    name: str
    """"function", "Class.attr", "ENV_NAME", "--flag[=value]", or the literal (SOURCE_TEXT)."""
    kind: str
    runners: str
    """Which runner(s) it must exist on: "v1", "v2", "both" or "cpu" (the CPU backend only)."""
    used_in: tuple[str, ...]
    """"path:Qualified.name" in this repository for each place that relies on it."""
    why: str
    keywords: tuple[str, ...] = ()
    """Parameters a call passes by these names (callables only): each must be in the signature."""
    via: str = ""
    """Set when src/ does not name it (so the used_in check looks for no name): how src/ relies on
    it anyway, e.g. the entry that calls it."""
