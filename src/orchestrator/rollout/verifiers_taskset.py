"""A PrimeIntellect verifiers (v1, verifiers==0.4.0) taskset as an asyncrl tool environment:

    [orchestrator.environment]
    class = "orchestrator.rollout.verifiers_taskset:VerifiersTaskset"
    args = {id = "my-taskset", num_tasks = 100}   # id, then the taskset's config fields

`id` is resolved as verifiers resolves it (`vf.load_taskset`: the installed module `<id>` with
- -> _, whose `__all__` exports one `vf.Taskset`); the other arguments are fields of that
taskset's config. Install the extra: `pip install asyncrl[verifiers]`.

Why asyncrl runs its own loop rather than verifiers' harness: the trainer needs the exact token
ids the model sampled, turn by turn, and the ids of the text between turns. verifiers' harnesses
talk to an OpenAI-style endpoint and record messages; exact ids come back only through its train
client (verifiers/v1/clients/train.py, `TrainClient`), which renders prompts with the
`renderers` package and calls vLLM's `/inference/v1/generate`, an endpoint `vllm serve`
registers only with `--enable-scale-out`. asyncrl's inference server is not that. So here the
taskset supplies the data, the tools and the rewards, and asyncrl's tool loop
(orchestrator/rollout/tool_episode.py) runs the conversation through the model's chat template:

- rows are `{"task": i}`, an index into the taskset's tasks (materialised once at start-up);
  `dataset(seed)` yields them forever, each pass reshuffled by `random.Random(f"{seed}/{pass}")`;
- `messages(row)`: the task's `system_prompt` (if any) as a system message, then its `prompt`
  (a string becomes a user message) in OpenAI form;
- `tools`: the `@vf.tool` methods of the taskset's toolsets (`Taskset.toolsets(config)`, shared)
  and of its task class's (`Task.toolsets(task.config)`), as plain functions named as verifiers
  names them for the model (`<TOOL_PREFIX or snake_case class>_<name>`, bare when TOOL_PREFIX is
  None), with the method's signature, type hints and docstring: orchestrator/rollout/tool_functions.py builds the schema
  from them. A result becomes the tool message's text as verifiers' MCP server would make it
  (a string as is, other values as indented JSON, a list item by item);
- `reward(messages, row)`: the conversation becomes a `vf.Trace` of that task (system, user,
  assistant turns with their tool calls, tool results; the model's turns marked sampled, the
  tools on the trace), `await task.score(trace)` runs the task's `@vf.reward` / `@vf.metric`
  methods and config-plugged ones (judges too), and the reward is `trace.reward`, the weighted sum.

asyncrl's tools are one list for the whole run, so every task of a taskset must offer the same
tools: tasks whose configs differ are checked at start-up and refused if their tools differ.

Refused at start-up, with a message naming the culprit (these need verifiers' own runtime):
- tasks that need a container (`NEEDS_CONTAINER`) or define `setup` / `finalize` /
  `stage_verifier` (they act on a sandbox runtime), rewards or metrics that require a `runtime`
  (verifiers' offline scoring would silently skip them), `@vf.stop` predicates, a taskset
  package that exports its own multi-agent `vf.Env`, infinite tasksets;
- toolsets that serve their own MCP handlers (`register`, e.g. a proxy to an MCP server), need
  `setup` / `setup_task`, keep tool-side `State`, run colocated or in a non-subprocess (sandbox)
  runtime, or point at a remote server (`url`).

Not supported, silently different or untested:
- harness tools: verifiers' default `bash` harness gives the model a shell; here the model has
  only the taskset's toolsets;
- arguments are checked by orchestrator/rollout/tool_functions.py strictly (an int is not "3"), where MCP's pydantic
  validation coerces; tool parameters must have types orchestrator/rollout/tool_functions.py describes (str, int, float,
  bool, list[...], dict, Literal[...], unions); the schema the model sees is orchestrator/rollout/tool_functions.py's: the
  same names, types and required parameters as verifiers' MCP schema, without pydantic's "title"
  keys, with the docstring's summary as description and its `Args:` entries on the parameters
  (verifiers sends the whole docstring); tool results that are images are refused (error
  tool message);
- judges (plugged or called from a reward) call a model over HTTP from the orchestrator: they run
  only where that endpoint and its key are reachable (not tested here);
- `trace.state` is the task's fresh default State, and the trace carries no token ids, timings,
  model calls or stop condition; metrics are computed but not reported.
"""

from __future__ import annotations

import inspect
import itertools
import json
import random
import typing
from collections.abc import Callable, Iterator

from rl.config import ConfigError

INSTALL = "pip install asyncrl[verifiers]"


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(f"orchestrator.rollout.verifiers_taskset needs the verifiers package ({INSTALL}): "
                          f"{type(e).__name__}: {e}") from None
    return vf


def _one_line(e: BaseException) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):  # a pydantic ValidationError: one "field: message" per error
        try:
            return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in errors())
        except Exception:
            pass
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


class VerifiersTaskset:
    """The tasks, tools and rewards of the verifiers taskset `id` (see the module docstring)."""

    tools: list = []  # (the class declares it: rl/preflight.py reads it as a tool environment)

    def __init__(self, id: str, **taskset_args):
        vf = _vf()
        self.id = id
        self.where = f"verifiers taskset {id!r}"
        taskset = self._load(vf, id, taskset_args)
        try:
            self.tasks = list(taskset)
        except Exception as e:
            raise ConfigError(f"{self.where}: loading its tasks failed: {_one_line(e)}") from None
        if not self.tasks:
            raise ConfigError(f"{self.where} has no tasks (environment.args {taskset_args})")
        self.taskset = taskset

        first = self.tasks[0]
        self._check_task(first)
        toolsets = [*type(taskset).toolsets(taskset.config), *type(first).toolsets(first.config)]
        self.tools = self._tools(toolsets)
        # Tasks whose configs differ from the first's may have other tools or hooks: check each
        # distinct config once (usually every task shares the taskset's one task config).
        spec = _spec(toolsets)
        seen = [first.config]  # (`id` is the taskset's here)
        for task in self.tasks[1:]:
            if any(task.config is c for c in seen):
                continue
            seen.append(task.config)
            if task.config == first.config:
                continue
            self._check_task(task)
            other = _spec([*type(taskset).toolsets(taskset.config), *type(task).toolsets(task.config)])
            if other != spec:
                raise ConfigError(
                    f"{self.where}: task {task.data.idx} offers other tools than task 0 "
                    f"({', '.join(other) or 'none'} vs {', '.join(spec) or 'none'}); asyncrl gives all "
                    "tasks of a run the same tools")
        try:
            _tool_text("probe")  # (mcp's private result conversion: fail here, not in every call)
        except ImportError as e:
            raise ConfigError(f"{self.where}: converting tool results as verifiers does needs mcp's "
                              f"MCPServer ({INSTALL}): {_one_line(e)}") from None

    # --- loading and checking --------------------------------------------------------------

    def _load(self, vf, id: str, args: dict):
        if not isinstance(id, str) or not id:
            raise ConfigError(f"orchestrator.environment.args.id = {id!r}: name a verifiers taskset")
        try:
            config_type = vf.taskset_config_type(id)
        except ModuleNotFoundError as e:
            module = id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()  # as verifiers imports it
            missing = getattr(e.__cause__, "name", None) or module
            if missing != module and not module.startswith(f"{missing}."):
                raise ConfigError(f"{self.where}: importing {module!r} failed: no module named {missing!r}") from None
            raise ConfigError(f"{self.where} not found: no module {module!r} (a taskset is an installed "
                              "package exporting its vf.Taskset in __all__)") from None
        except Exception as e:
            raise ConfigError(f"{self.where}: {_one_line(e)}") from None
        try:
            config = config_type(id=id, **args)
        except Exception as e:
            raise ConfigError(f"{self.where}: environment.args {args} do not fit its config "
                              f"{config_type.__name__}: {_one_line(e)}") from None
        try:
            env_class = vf.environment_class(id)
            if env_class is not vf.SingleAgentEnv:
                raise ConfigError(f"{self.where} exports its own environment {env_class.__name__} "
                                  "(a multi-agent vf.Env), which asyncrl cannot run")
            taskset = vf.load_taskset(config)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"{self.where}: loading failed: {_one_line(e)}") from None
        if not taskset.bounded:
            raise ConfigError(f"{self.where} is infinite (INFINITE = True): asyncrl needs its tasks as a list")
        return taskset

    def _check_task(self, task) -> None:
        from verifiers.v1.task import Task

        cls, name = type(task), type(task).__name__
        if cls.NEEDS_CONTAINER:
            raise ConfigError(f"{self.where}: task {name} needs a container (NEEDS_CONTAINER), "
                              "which asyncrl does not provide")
        for hook in ("setup", "finalize", "stage_verifier"):
            if getattr(cls, hook) is not getattr(Task, hook):
                raise ConfigError(f"{self.where}: task {name} defines {hook}(), which acts on a verifiers "
                                  "runtime asyncrl does not provide")
        needs_runtime = [fn.__name__ for kind in ("reward", "metric") for fn in task.hooks(kind)
                         if _requires_runtime(fn)]
        if needs_runtime:
            raise ConfigError(f"{self.where}: task {name}'s {', '.join(needs_runtime)} "
                              f"{'needs' if len(needs_runtime) == 1 else 'need'} a runtime (a sandbox), "
                              "which asyncrl does not provide")
        not_async = [fn.__name__ for kind in ("reward", "metric") for fn in task.hooks(kind)
                     if not inspect.iscoroutinefunction(inspect.unwrap(fn))]  # (plugged ones wrap)
        if not_async:
            raise ConfigError(f"{self.where}: task {name}'s {', '.join(not_async)}: must be async "
                              "(verifiers awaits every reward and metric)")
        stops = [fn.__name__ for fn in task.hooks("stop")]
        if stops:
            raise ConfigError(f"{self.where}: task {name} has stop predicates ({', '.join(stops)}), which "
                              "asyncrl's loop does not run (it stops at an answer without a tool call, "
                              "orchestrator.environment.max_turns or seq_len)")

    def _tools(self, toolsets) -> list[Callable]:
        import verifiers.v1 as vf
        from verifiers.v1.mcp import Toolset
        from verifiers.v1.mcp.server import ServerBase
        from verifiers.v1.runtimes import SubprocessConfig
        from verifiers.v1.state import State, state_cls
        from verifiers.v1.utils.decorators import discover_decorated

        from orchestrator.rollout.tool_functions import Tool

        tools: dict[str, Callable] = {}
        self._vf_tools = []
        for ts in toolsets:
            cls, name, cfg = type(ts), type(ts).__name__, ts.config
            why = None
            if cls.register is not Toolset.register:
                why = "serves its tools through its own MCP handlers (register), not @vf.tool methods"
            elif cls.setup is not ServerBase.setup or cls.setup_task is not ServerBase.setup_task:
                why = "needs its server's setup / setup_task"
            elif state_cls(cls) is not State:
                why = f"keeps tool-side state ({state_cls(cls).__name__}) across calls"
            elif getattr(cfg, "url", None):
                why = f"is a remote MCP server ({cfg.url})"
            elif getattr(cfg, "colocated", False):
                why = "runs colocated with the harness (in its sandbox)"
            elif not isinstance(getattr(cfg, "runtime", None) or SubprocessConfig(), SubprocessConfig):
                why = f"runs in a {type(cfg.runtime).__name__} runtime (a sandbox)"
            if why:
                raise ConfigError(f"{self.where}: toolset {name} {why}; asyncrl calls @vf.tool methods "
                                  "directly, in its own process, without verifiers' tool servers")
            for method in discover_decorated(ts, "tool"):
                raw = getattr(method, "tool_name", None) or method.__name__
                full = f"{ts.server_name}_{raw}" if ts.server_name else raw
                if full in tools:
                    raise ConfigError(f"{self.where}: two tools named {full!r}")
                try:
                    tools[full] = _wrap(full, method)
                    schema = Tool.from_function(tools[full]).schema["function"]
                except Exception as e:
                    raise ConfigError(f"{self.where}: tool {full}: {_one_line(e)}") from None
                # As the trace records the tools offered (verifiers: the MCP server's listing).
                self._vf_tools.append(vf.Tool(name=full, description=(method.__doc__ or "").strip(),
                                              parameters=schema["parameters"]))
        return list(tools.values())

    # --- the tool-environment contract (orchestrator/rollout/environment.py) ------------------------

    def dataset(self, seed: int) -> Iterator[dict]:
        for n in itertools.count():
            order = list(range(len(self.tasks)))
            random.Random(f"{seed}/{n}").shuffle(order)
            yield from ({"task": i} for i in order)

    def task(self, row: dict):
        return self.tasks[row["task"]]

    def messages(self, row: dict) -> list[dict]:
        data = self.task(row).data
        out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            out.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            out += [_openai(m) for m in data.prompt]
        return out

    async def reward(self, messages: list[dict], row: dict) -> float:
        task = self.task(row)
        trace = self.trace(task, messages, opening=len(self.messages(row)))
        await task.score(trace)
        return float(trace.reward)

    def trace(self, task, messages: list[dict], opening: int = 0):
        """The conversation as a verifiers Trace of `task`; assistant messages after the first
        `opening` messages are the model's (sampled)."""
        vf = _vf()
        from verifiers.v1.state import state_cls

        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                         agent=vf.AgentInfo(config=vf.AgentConfig(), name="asyncrl"),
                         state=state_cls(type(task))(), tools=self._vf_tools)
        for i, m in enumerate(messages):
            message = _vf_message(vf, m)
            trace.nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=message,
                                              tools=self._vf_tools if i == 0 else [],
                                              sampled=i >= opening and isinstance(message, vf.AssistantMessage)))
        return trace


# --- helpers ------------------------------------------------------------------------------


def _requires_runtime(fn) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _wrap(name: str, method) -> Callable:
    """The bound @vf.tool `method` as a plain function named `name` (what orchestrator/rollout/tool_functions.py describes
    and calls), sync or async as the method is; its result as MCP would put it in text."""
    hints = typing.get_type_hints(method)
    signature = inspect.signature(method)  # bound: no self
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
    signature = signature.replace(parameters=params, return_annotation=hints.get("return", signature.return_annotation))

    if inspect.iscoroutinefunction(method):
        async def tool(**kwargs):
            return _tool_text(await method(**kwargs))
    else:
        def tool(**kwargs):
            return _tool_text(method(**kwargs))

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = method.__doc__
    tool.__module__ = method.__module__
    tool.__signature__ = signature
    tool.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not p.empty}
    if signature.return_annotation is not signature.empty:
        tool.__annotations__["return"] = signature.return_annotation
    return tool


def _tool_text(result) -> str:
    """The text verifiers' harness would put in the tool message: MCPServer's conversion of the
    return value to content blocks, then the harness's blocks-to-chat-content."""
    from mcp.server.mcpserver.utilities.func_metadata import _convert_to_content
    from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

    content = mcp_content_to_chat_content(_convert_to_content(result))
    if not isinstance(content, str):
        raise TypeError("the tool returned non-text content (an image); asyncrl's tool messages are text")
    return content


def _spec(toolsets) -> dict[str, tuple]:
    """What the model would see of these toolsets: {tool name: (doc, signature)}."""
    from verifiers.v1.utils.decorators import discover_decorated

    out = {}
    for ts in toolsets:
        for method in discover_decorated(ts, "tool"):
            raw = getattr(method, "tool_name", None) or method.__name__
            out[f"{ts.server_name}_{raw}" if ts.server_name else raw] = (method.__doc__, str(inspect.signature(method)))
    return out


def _openai(message) -> dict:
    """A verifiers message in the OpenAI form asyncrl's templates and rewards read."""
    out = message.model_dump(exclude_none=True, include={"role", "content", "reasoning_content",
                                                          "tool_call_id", "name"})
    out.setdefault("content", "")
    calls = getattr(message, "tool_calls", None)
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in calls]
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _vf_message(vf, m: dict):
    role, content = m.get("role"), m.get("content")
    if role == "system":
        return vf.SystemMessage(content=content or "")
    if role == "user":
        return vf.UserMessage(content=content or "")
    if role == "assistant":
        calls = [vf.ToolCall(id=c.get("id") or f"call_{i}", name=c["function"]["name"],
                             arguments=a if isinstance(a := c["function"].get("arguments", {}), str)
                             else json.dumps(a, ensure_ascii=False))
                 for i, c in enumerate(m.get("tool_calls") or [])]
        return vf.AssistantMessage(content=content, reasoning_content=m.get("reasoning_content"),
                                   tool_calls=calls or None)
    if role == "tool":
        return vf.ToolMessage(tool_call_id=m.get("tool_call_id") or "", content=content or "",
                              name=m.get("name") or None)
    raise ValueError(f"a message with role {role!r}: verifiers traces hold system, user, assistant and tool messages")
