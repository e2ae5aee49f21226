"""The vLLM contract (src/inference/vllm_contract/): every vLLM internal the project touches is
listed there, and each entry holds on the installed vLLM, on every runner it names (V1 and V2
model runners, the GPU and CPU workers). An upgrade that moves one fails here, naming the entry and
the file of ours that relies on it, instead of failing a user's run. docs/vllm_contract.md.

No engine starts: modules are imported, classes read with getattr, and instance attributes (GPU
runners cannot be built on CPU) read from the classes' source with ast. The other direction is
checked over our own source: every `vllm` import, every attribute read off a vLLM object the
contract's RECEIVERS name, every VLLM_* variable and every `vllm serve` flag needs an entry, and
every entry's used_in must still name a definition that mentions it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import textwrap
import typing
from functools import cache
from pathlib import Path

import pytest

from conftest import ROOT
from inference.vllm_contract import kinds
from inference.vllm_contract import our_files as our_side
from inference.vllm_contract.entries import CLI_ARGS, USES
from inference.vllm_contract.kinds import (ASSIGNED_ATTR, CLASS_ATTR, CLI_FLAG, ENV, INSTANCE_ATTR, KINDS, MODEL_RUNNER,
                                           MODULE_ATTR, RUNNERS, SOURCE_TEXT, WORKER, Use)
from inference.vllm_contract.our_files import CLI, Receiver

# --- the checker: does one entry hold on the installed vLLM? -----------------------------------


def problem(use: Use) -> str | None:
    """Why `use` does not hold on the installed vLLM, or None."""
    try:
        if use.kind == ENV:
            import vllm.envs

            return None if use.name in vllm.envs.environment_variables else "not a variable vllm.envs knows"
        if use.kind == CLI_FLAG:
            return flag_problem(use)
        if use.kind == SOURCE_TEXT:
            spec = importlib.util.find_spec(use.module)
            return None if use.name in Path(spec.origin).read_text() else f"not in {spec.origin}"
        if use.kind == ASSIGNED_ATTR:
            return assigned_problem(use)
        if use.module in (MODEL_RUNNER, WORKER):
            table = kinds.RUNNER_CLASSES if use.module == MODEL_RUNNER else kinds.WORKER_CLASSES
            found = [f"{spec}: {p}" for spec in table[use.runners] if (p := member_problem(load(spec), use))]
            return "; ".join(found) or None
        if use.kind == MODULE_ATTR:
            return keywords_problem(module_attr(use.module, use.name), use.keywords)
        owner, _, _ = use.name.rpartition(".")
        return member_problem(module_attr(use.module, owner), use)
    except Exception as e:  # a module that does not import, a class gone: the entry fails with it
        return f"{type(e).__name__}: {e}"


def assigned_problem(use: Use) -> str | None:
    """An ASSIGNED_ATTR entry: the module's own source assigns `<something>.<attr> = ...`, or one
    of its classes declares `attr` as a field."""
    spec = importlib.util.find_spec(use.module)
    attr = use.name.rpartition(".")[2]
    for n in ast.walk(ast.parse(Path(spec.origin).read_text())):
        targets = (n.targets if isinstance(n, ast.Assign)
                   else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        if any(isinstance(t, ast.Attribute) and t.attr == attr for t in targets):
            return None
        if isinstance(n, ast.ClassDef) and attr in {t.target.id for t in n.body
                                                    if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}:
            return None
    return f"{spec.origin} assigns no .{attr}"


def load(spec: str):
    """The class a "module:Class" spec names."""
    module, _, name = spec.partition(":")
    return module_attr(module, name)


def module_attr(module: str, dotted: str):
    """`dotted` (a name, or Class.attr...) from `module`, or a submodule as `from module import
    name` would find it."""
    obj = importlib.import_module(module)
    first, *rest = dotted.split(".")
    obj = getattr(obj, first) if hasattr(obj, first) else importlib.import_module(f"{module}.{first}")
    for part in rest:
        obj = getattr(obj, part)
    return obj


def member_problem(cls: type, use: Use) -> str | None:
    """The attribute `use` names on `cls`: a class attribute by getattr; an instance attribute
    also where the class or a base assigns self.<attr> or declares it as a field."""
    attr = use.name.rpartition(".")[2]
    if hasattr(cls, attr):
        return keywords_problem(getattr(cls, attr), use.keywords)
    if use.kind == INSTANCE_ATTR and any(attr in assigned_names(k) for k in cls.__mro__):
        return None
    return f"{cls.__module__}.{cls.__qualname__} has no {use.kind} {attr}"


@cache
def assigned_names(cls: type) -> frozenset[str]:
    """What `cls`'s own source defines: names in the class body (methods, fields, class
    variables) and every self.<name> assigned in its methods."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # builtins, classes made at run time: nothing to read
        return frozenset()
    body = tree.body[0]
    names = set()
    for stmt in body.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(body):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return frozenset(names)


def keywords_problem(obj, keywords: tuple[str, ...]) -> str | None:
    """The parameters a call of ours passes by name must be in `obj`'s signature (a TypedDict:
    its keys)."""
    if not keywords:
        return None
    if isinstance(obj, type) and hasattr(obj, "__required_keys__"):
        accepted = set(obj.__annotations__)
    else:
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        accepted = {n for n, p in inspect.signature(obj).parameters.items() if p.kind in kinds}
    missing = [k for k in keywords if k not in accepted]
    return f"{getattr(obj, '__qualname__', obj)} takes no parameter {', '.join(missing)}" if missing else None


@cache
def serve_parser():
    """`vllm serve`'s argument parser, built as inference/server.py builds it."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return importlib.import_module(CLI_ARGS).make_arg_parser(FlexibleArgumentParser(prog="contract"))


def flag_problem(use: Use) -> str | None:
    flag, _, value = use.name.partition("=")
    action = serve_parser()._option_string_actions.get(flag)
    if action is None:
        return f"`vllm serve` has no flag {flag}"
    if value and value not in (action.choices or ()):
        return f"{flag} does not accept {value} (choices: {action.choices})"
    return None


def describe(use: Use) -> str:
    return (f"{use.module} {use.name} ({use.kind}, runners {use.runners}), relied on by "
            f"{', '.join(use.used_in)} ({use.why})")


@pytest.mark.parametrize("use", USES, ids=lambda u: f"{u.module.rpartition('.')[2]}.{u.name}")
def test_entry_holds_on_the_installed_vllm(use):
    assert (why := problem(use)) is None, f"{describe(use)}: {why}"


# --- the checker can fail -----------------------------------------------------------------------

WRONG = (
    Use("vllm.v1.engine.async_llm", "no_such_function", MODULE_ATTR, "both", ("x:y",), "made up"),
    Use("vllm.no_such_module", "AsyncLLM", MODULE_ATTR, "both", ("x:y",), "made up"),
    Use("vllm.v1.engine.async_llm", "AsyncLLM.no_such_method", CLASS_ATTR, "both", ("x:y",), "made up"),
    Use("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", CLASS_ATTR, "both", ("x:y",), "made up",
        ("no_such_keyword",)),
    Use(WORKER, "no_such_attribute", INSTANCE_ATTR, "both", ("x:y",), "made up"),
    Use("vllm.envs", "VLLM_NO_SUCH_VARIABLE", ENV, "both", ("x:y",), "made up"),
    Use(CLI_ARGS, "--no-such-flag", CLI_FLAG, "both", ("x:y",), "made up"),
    Use(CLI_ARGS, "--logprobs-mode=no_such_mode", CLI_FLAG, "both", ("x:y",), "made up"),
    Use("vllm.outputs", "no such text in this file", SOURCE_TEXT, "both", ("x:y",), "made up"),
)


@pytest.mark.parametrize("use", WRONG, ids=lambda u: u.name)
def test_the_checker_reports_a_made_up_entry(use):
    assert problem(use) is not None, f"the checker passed a made-up entry: {use}"


def test_the_checker_tells_the_runners_apart():
    """The V1 runner keeps its requests in `requests`, the V2 one in `req_states`: an entry is
    checked on exactly the runners it names, and a failure names the runner class."""
    requests = Use(MODEL_RUNNER, "requests", INSTANCE_ATTR, "v1", ("x:y",), "V1 only")
    assert problem(requests) is None
    wrong = problem(Use(MODEL_RUNNER, "requests", INSTANCE_ATTR, "both", ("x:y",), "V1 only"))
    assert wrong and "vllm.v1.worker.gpu.model_runner:GPUModelRunner" in wrong, wrong
    assert "gpu_model_runner:GPUModelRunner" not in wrong, wrong
    assert problem(Use(MODEL_RUNNER, "req_states", INSTANCE_ATTR, "v2", ("x:y",), "V2 only")) is None


def test_max_lora_ranks_are_vllms():
    from vllm.config.lora import MaxLoRARanks

    from inference.server import MAX_LORA_RANKS

    assert MAX_LORA_RANKS == typing.get_args(MaxLoRARanks), (
        f"inference/server.py MAX_LORA_RANKS {MAX_LORA_RANKS} is not vLLM's {typing.get_args(MaxLoRARanks)}")


# --- the list against our source: complete, and still current ------------------------------

FLAG = re.compile(r"^--?[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")
ENV_NAME = re.compile(r"^VLLM_[A-Z0-9_]+$")


def our_files() -> list[str]:
    paths = {p.relative_to(ROOT).as_posix() for d in our_side.SCANNED for p in (ROOT / d).rglob("*.py")}
    return sorted(p for p in paths if not p.startswith(our_side.CONTRACT))


def files_of(use: Use) -> set[str]:
    return {place.partition(":")[0] for place in use.used_in}


def find(tree: ast.AST, dotted: str) -> ast.AST | None:
    """The definition `dotted` names in a module: a function, class, method, or a module- or
    class-level assignment."""
    node = tree
    for part in dotted.split("."):
        found = None
        for stmt in getattr(node, "body", []):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == part:
                found = stmt
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = stmt
        if found is None:
            return None
        node = found
    return node


def unlisted_imports(path: str, source: str, uses=USES) -> list[str]:
    """`vllm` imports in `source` that no entry listing `path` covers."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found = [(a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            found = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in found:
            if not any(u.module == module and (not name or u.name == name or u.name.startswith(f"{name}."))
                       and path in files_of(u) for u in uses):
                out.append(f"{path}:{node.lineno} imports {module}{f' {name}' if name else ''}")
    return out


def read_off(node: ast.AST, expr: str) -> list[tuple[str, int]]:
    """Attributes read or set on the expression `expr` within `node`, or named by getattr,
    hasattr or setattr on it."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and ast.unparse(n.value) == expr:
            out.append((n.attr, n.lineno))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "hasattr", "setattr") and len(n.args) >= 2 and ast.unparse(n.args[0]) == expr
              and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)):
            out.append((n.args[1].value, n.lineno))
    return out


def dest(flag: str) -> str:
    """The attribute argparse stores a flag under (--no-x: x's)."""
    return flag.partition("=")[0].lstrip("-").removeprefix("no-").replace("-", "_")


def names_member(use: Use, owner: str, attr: str) -> bool:
    if owner in (MODEL_RUNNER, WORKER):
        return use.module == owner and use.name == attr
    if owner == CLI:
        return use.kind == CLI_FLAG and dest(use.name) == attr
    module, _, cls = owner.partition(":")
    if our_side.foreign(owner):
        # Not vLLM's class (a torch Module or Parameter, a dict of ours): vLLM sets the attribute.
        return use.kind == ASSIGNED_ATTR and use.name == f"{cls}.{attr}"
    return use.module == module and use.name == (f"{cls}.{attr}" if cls else attr)


def on_foreign_class(owner: str, attr: str) -> bool:
    """A foreign owner's own attribute (nn.Module.modules, dict.get): no entry needed."""
    return our_side.foreign(owner) and hasattr(load(owner), attr)


def target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for e in target.elts for n in target_names(e)]
    if isinstance(target, ast.Starred):
        return target_names(target.value)
    return []


# Builtins whose result is (or holds) what their first argument gives.
PASS_THROUGH = ("getattr", "next", "iter", "list", "dict", "tuple", "sorted", "reversed", "enumerate", "zip")


class Reached:
    """Within one function (or a module's or class's own statements): the vLLM objects the
    receivers name there, and every expression reached from one: an attribute, call, subscript
    or await of it, a name assigned from it, a loop variable over it. Attributes of ours (an
    OWN_PREFIXES name, what our class sets on self) lead to our objects, not vLLM's."""

    def __init__(self, unit: ast.AST, roots: dict[str, Receiver], own: set[str]):
        self.unit, self.roots, self.own = unit, roots, own
        self.names: set[str] = set()
        changed = True
        while changed:
            changed = False
            for target, value in self.assignments():
                if self.reached(value):
                    new = set(target_names(target)) - self.names - set(roots)
                    self.names |= new
                    changed = changed or bool(new)

    def assignments(self):
        for n in ast.walk(self.unit):
            if isinstance(n, ast.Assign):
                yield from ((t, n.value) for t in n.targets)
            elif isinstance(n, (ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
                yield n.target, n.value
            elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                yield n.target, n.iter
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                yield from ((i.optional_vars, i.context_expr) for i in n.items if i.optional_vars is not None)

    def ours(self, node: ast.Attribute) -> bool:
        return node.attr.startswith(our_side.OWN_PREFIXES) or (
            isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.own)

    def foreign_step(self, value: ast.AST, attr: str | None) -> bool:
        """Whether stepping off `value` by `attr` (None: indexing) leaves vLLM's reach: `value`
        is a foreign receiver holding no vLLM objects (a tensor, an array, a torch module: not a
        container), and the step is its class's own (a tensor's slice, .to, .numpy, .modules)."""
        r = self.roots.get(ast.unparse(value))
        return (r is not None and our_side.foreign(r.owner) and r.owner.startswith(("torch", "numpy"))
                and (attr is None or on_foreign_class(r.owner, attr)))

    def reached(self, node: ast.AST) -> bool:
        while True:
            if ast.unparse(node) in self.roots or (isinstance(node, ast.Name) and node.id in self.names):
                return True
            if isinstance(node, ast.Attribute):
                if self.ours(node) or self.foreign_step(node.value, node.attr):
                    return False
                node = node.value
            elif isinstance(node, ast.Subscript):
                if self.foreign_step(node.value, None):
                    return False
                node = node.value
            elif isinstance(node, (ast.Await, ast.Starred)):
                node = node.value
            elif isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name):
                    if node.func.id not in PASS_THROUGH or not node.args:
                        return False  # a function of ours: its result is ours
                    named = node.args[1] if len(node.args) > 1 else None
                    if (node.func.id == "getattr" and isinstance(named, ast.Constant) and isinstance(named.value, str)
                            and (named.value.startswith(our_side.OWN_PREFIXES)
                                 or ast.unparse(node.args[0]) == "self" and named.value in self.own)):
                        return False  # getattr(self, "_asyncrl_base"): ours
                    node = node.args[0]
                else:
                    node = node.func
            else:
                return False

    def accesses(self) -> list[tuple[ast.AST, str, int]]:
        """(object, attribute, line) for each attribute read or set on an object reached from a
        vLLM object, or named by getattr, hasattr or setattr on one."""
        out = []
        for n in ast.walk(self.unit):
            if isinstance(n, ast.Attribute) and self.reached(n.value) and not self.ours(n):
                out.append((n.value, n.attr, n.lineno))
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "hasattr", "setattr") and len(n.args) >= 2 and self.reached(n.args[0])
                  and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                  and not n.args[1].value.startswith(our_side.OWN_PREFIXES)):
                out.append((n.args[0], n.args[1].value, n.lineno))
        return out


def units(tree: ast.Module):
    """(dotted name, node, the class it is a method of) for each function and method, and
    ("", node, None) for the module's and each class's own statements."""
    loose = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield stmt.name, stmt, None
        elif isinstance(stmt, ast.ClassDef):
            for inner in stmt.body:
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{stmt.name}.{inner.name}", inner, stmt
                else:
                    loose.append(inner)
        else:
            loose.append(stmt)
    yield "", ast.Module(body=loose, type_ignores=[]), None


def applies(receiver: Receiver, dotted: str) -> bool:
    return receiver.scope == "" or dotted == receiver.scope or dotted.startswith(f"{receiver.scope}.")


def unlisted_accesses(path: str, source: str, receivers=None, uses=USES) -> list[str]:
    """Attributes read off the vLLM objects the receivers of `path` name, and off everything
    reached from them, that no entry listing `path` covers. An object reached from a vLLM object
    (a call's result, a loop variable over one) that no receiver names is itself reported: the
    receivers must say what it is, so that no name on it goes unchecked."""
    receivers = [r for r in (our_side.RECEIVERS if receivers is None else receivers) if r.path == path]
    tree = ast.parse(source)
    out = []
    for r in receivers:
        node = find(tree, r.scope) if r.scope else tree
        if node is None:
            out.append(f"RECEIVERS: {r.path} {r.scope} is not defined")
        elif not read_off(node, r.expr) and not any(isinstance(n, (ast.Attribute, ast.Subscript))
                                                    and ast.unparse(n.value) == r.expr for n in ast.walk(node)):
            out.append(f"RECEIVERS: nothing is read off {r.expr} in {r.path} {r.scope or '(module)'}: fix or drop "
                       "the receiver")
    for dotted, unit, cls in units(tree):
        roots = {r.expr: r for r in receivers if applies(r, dotted)}
        if not roots:
            continue
        reached = Reached(unit, roots, assigned_in(cls) if cls is not None else set())
        for obj, attr, line in reached.accesses():
            key = ast.unparse(obj)
            r = roots.get(key)
            if r is None:
                out.append(f"{path}:{line} {key}.{attr}: {key} is reached from a vLLM object, and no receiver says "
                           "what it is")
            elif not on_foreign_class(r.owner, attr) and not any(
                    names_member(u, r.owner, attr) and path in files_of(u) for u in uses):
                out.append(f"{path}:{line} {key}.{attr} ({r.owner})")
    return sorted(set(out))


def assigned_in(cls: ast.ClassDef) -> set[str]:
    """What a class of ours defines: its methods and class-level names, and self.<name> it sets."""
    names = {s.name for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return names | {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"}


def strings(node: ast.AST) -> list[tuple[str, int]]:
    return [(n.value, n.lineno) for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def unlisted_env(path: str, source: str, uses=USES) -> list[str]:
    """VLLM_* variable names in `source` that no ENV entry listing `path` covers."""
    return [f"{path}:{line} {text}" for text, line in strings(ast.parse(source)) if ENV_NAME.match(text)
            and not any(u.kind == ENV and u.name == text and path in files_of(u) for u in uses)]


def unlisted_flags(path: str, source: str, names: tuple[str, ...], uses=USES) -> list[str]:
    """`vllm serve` flags among the strings of `source` (within the top-level `names`; () all)
    that no CLI_FLAG entry listing `path` covers."""
    tree = ast.parse(source)
    nodes = [find(tree, n) for n in names] if names else [tree]
    if None in nodes:
        return [f"CLI_FLAG_SOURCES: {path} defines no {names[nodes.index(None)]}"]
    return [f"{path}:{line} {text}" for node in nodes for text, line in strings(node) if FLAG.match(text)
            and not any(u.kind == CLI_FLAG and u.name.partition("=")[0] == text and path in files_of(u)
                        for u in uses)]


def mentions(use: Use) -> tuple[str, ...]:
    """What a definition that relies on `use` must say (one of)."""
    if use.kind == CLI_FLAG:
        return use.name.partition("=")[0], dest(use.name)
    if use.kind == ENV or use.module in (MODEL_RUNNER, WORKER):
        return (use.name,)
    return (use.name.rpartition(".")[2],)


def stale_places(use: Use) -> list[str]:
    """used_in places that no longer exist, or no longer mention what the entry names."""
    out = []
    for place in use.used_in:
        path, _, dotted = place.partition(":")
        file = ROOT / path
        if not file.is_file():
            out.append(f"{place}: no such file")
            continue
        source = file.read_text()
        node = find(ast.parse(source), dotted)
        if node is None:
            out.append(f"{place}: {path} defines no {dotted}")
        elif not (use.via or use.kind == SOURCE_TEXT) and not any(m in ast.get_source_segment(source, node)
                                                                 for m in mentions(use)):
            out.append(f"{place} does not mention {' or '.join(mentions(use))}")
    return out


def test_every_vllm_import_is_listed():
    missing = [m for path in our_files() for m in unlisted_imports(path, (ROOT / path).read_text())]
    assert not missing, ("vLLM imports with no entry (listing that file) in "
                         "src/inference/vllm_contract/entries.py USES:\n" + "\n".join(missing))


def test_every_attribute_read_off_a_vllm_object_is_listed():
    paths = sorted({r.path for r in our_side.RECEIVERS})
    missing = [m for path in paths for m in unlisted_accesses(path, (ROOT / path).read_text())]
    assert not missing, ("vLLM attributes our code uses with no entry (listing that file) in "
                         "src/inference/vllm_contract/entries.py USES:\n" + "\n".join(missing))


def unseen_engine_reads(path: str, source: str, receivers=None) -> list[str]:
    """Attributes read off the engine (under a name some receiver gives AsyncLLM: `self.engine`,
    `engine`) in a definition of `path` that no receiver covers. Function parameters are not
    followed, so a file the engine is handed to (a split-off module, a helper) would otherwise
    read anything off it unchecked."""
    receivers = our_side.RECEIVERS if receivers is None else receivers
    names = {r.expr for r in receivers if r.owner == our_side.ASYNC_LLM}
    out = []
    for dotted, unit, _ in units(ast.parse(source)):
        for n in ast.walk(unit):
            if (isinstance(n, ast.Attribute) and (expr := ast.unparse(n.value)) in names
                    and not any(r.path == path and r.expr == expr and applies(r, dotted) for r in receivers)):
                out.append(f"{path}:{n.lineno} {expr}.{n.attr} in {dotted or '(module)'}")
    return out


def test_every_file_that_reads_off_the_engine_has_a_receiver():
    unseen = [m for path in our_files() for m in unseen_engine_reads(path, (ROOT / path).read_text())]
    assert not unseen, ("attributes read off the engine where no receiver in "
                        "src/inference/vllm_contract/our_files.py RECEIVERS names it (so the check above never "
                        "sees them):\n" + "\n".join(unseen))


def test_every_vllm_variable_and_flag_is_listed():
    missing = [m for path in our_files() for m in unlisted_env(path, (ROOT / path).read_text())]
    missing += [m for path, names in our_side.CLI_FLAG_SOURCES.items()
                for m in unlisted_flags(path, (ROOT / path).read_text(), names)]
    assert not missing, ("VLLM_* variables or `vllm serve` flags with no entry (listing that file) in "
                         "src/inference/vllm_contract/entries.py USES:\n" + "\n".join(missing))


def test_every_entry_is_still_used_where_it_says():
    stale = [f"{u.module} {u.name}: {s}" for u in USES for s in stale_places(u)]
    assert not stale, "entries of src/inference/vllm_contract/entries.py USES whose used_in is out of date:\n" + \
        "\n".join(stale)


def test_entries_are_well_formed():
    bad = [f"{u.module} {u.name}: {why}" for u in USES for why in (
        u.kind not in KINDS and f"kind {u.kind!r} is not one of KINDS",
        u.runners not in RUNNERS and f"runners {u.runners!r} is not one of {RUNNERS}",
        not u.used_in and "used_in is empty",
        *(":" not in p and f"used_in {p!r} is not path:name" for p in u.used_in),
        u.module in (MODEL_RUNNER, WORKER) and u.kind not in (CLASS_ATTR, INSTANCE_ATTR)
        and "runner and worker entries are class or instance attributes",
    ) if why]
    seen: dict[tuple[str, str], int] = {}
    for u in USES:
        seen[u.module, u.name] = seen.get((u.module, u.name), 0) + 1
    bad += [f"{m} {n}: listed {k} times (one entry, several used_in)" for (m, n), k in seen.items() if k > 1]
    assert not bad, "\n".join(bad)


# --- the coverage checks can fail ------------------------------------------------------------

def test_the_coverage_checks_report_what_is_unlisted():
    here = "src/inference/new.py"
    listed = (Use("vllm.foo", "bar", MODULE_ATTR, "both", (f"{here}:f",), "listed"),)
    assert unlisted_imports(here, "from vllm.foo import bar\nimport vllm\n", listed) == [f"{here}:2 imports vllm"]
    assert unlisted_imports("src/other.py", "from vllm.foo import bar\n", listed), "listed for another file only"
    engine = Receiver(here, "f", "self.engine", our_side.ASYNC_LLM)
    source = "def f(self):\n    self.engine.collective_rpc()\n    getattr(self.engine, 'new_thing')\n"
    listed = (Use("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", CLASS_ATTR, "both", (f"{here}:f",), "x"),)
    unlisted = [f"{here}:3 self.engine.new_thing ({our_side.ASYNC_LLM})"]
    assert unlisted_accesses(here, source, [engine], listed) == unlisted
    assert unlisted_accesses(here, source, [Receiver(here, "g", "self.engine", our_side.ASYNC_LLM)], listed)
    assert unlisted_env(here, "os.environ['VLLM_NEW'] = '1'\n", ()) == [f"{here}:1 VLLM_NEW"]
    assert unlisted_flags(here, "ARGS = ['--new-flag', '1', '-x']\n", (), ()) == [f"{here}:1 --new-flag",
                                                                                  f"{here}:1 -x"]


def test_the_receiver_check_reports_a_file_the_engine_is_handed_to():
    here = "src/inference/new.py"
    source = "async def f(engine):\n    await engine.abort([])\n"
    assert unseen_engine_reads(here, source) == [f"{here}:2 engine.abort in f"]
    assert not unseen_engine_reads(here, source, (*our_side.RECEIVERS, Receiver(here, "f", "engine",
                                                                                our_side.ASYNC_LLM)))


def test_the_used_in_check_reports_a_stale_place():
    real = "src/inference/server.py:vllm_args"
    assert not stale_places(Use(CLI_ARGS, "--seed", CLI_FLAG, "both", (real,), "used"))
    assert stale_places(Use(CLI_ARGS, "--no-such-flag", CLI_FLAG, "both", (real,), "not used there"))
    assert stale_places(Use("vllm", "x", MODULE_ATTR, "both", ("src/inference/server.py:no_such_def",), "gone"))
    assert stale_places(Use("vllm", "x", MODULE_ATTR, "both", ("src/no_such_file.py:f",), "gone"))


def test_the_coverage_check_follows_chains_from_vllm_objects():
    """A name read off what a vLLM object gives (a call's result, a loop variable over one) is
    checked too: an unlisted one fails, and so does an object reached from a vLLM object that no
    receiver names (issue 60: get_model().no_such_vllm_thing and tensor.no_such_loader passed)."""
    path = our_side.EXT
    source = (ROOT / path).read_text()
    assert not unlisted_accesses(path, source)
    reload_line = "        repack_cpu_experts(self.model_runner.get_model())\n"
    loader_line = "                tensor.weight_loader = layerwise._get_original_loader(tensor)\n"
    assert reload_line in source and loader_line in source
    mutated = source.replace(reload_line, reload_line + "        self.model_runner.get_model().no_such_vllm_thing\n", 1)
    mutated = mutated.replace(loader_line, loader_line + "                tensor.no_such_loader(tensor)\n")
    mutated = mutated.replace(loader_line, loader_line + "                other = layerwise.LAYERWISE_INFO.get(layer)\n"
                                                         "                other.y\n")
    found = unlisted_accesses(path, mutated)
    assert any("self.model_runner.get_model().no_such_vllm_thing (torch.nn:Module)" in f for f in found), found
    assert any("tensor.no_such_loader (torch.nn:Parameter)" in f for f in found), found
    assert any("other.y: other is reached from a vLLM object, and no receiver says what it is" in f
               for f in found), found
    assert len(found) == 3, found
    # Without its entry, the loader vLLM sets on a parameter is unlisted too.
    uses = tuple(u for u in USES if u.name != "Parameter.weight_loader")
    assert [f for f in unlisted_accesses(path, source, uses=uses) if "tensor.weight_loader" in f], "not checked"


def test_a_data_parallel_client_answers_collective_rpc_with_engine_0_only():
    """What all_workers.every_worker is for, pinned on vLLM's own classes: AsyncLLM.collective_rpc
    goes through the engine core client's call_utility_async, which the data-parallel client
    (DPLBAsyncMPClient) sends to every engine and answers with engine 0's list; its
    call_utility_all_async answers with every engine's, which every_worker flattens."""
    import asyncio

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    from inference.all_workers import every_worker

    client = object.__new__(DPLBAsyncMPClient)
    calls = []

    async def call_utility_all_async(method, *args):
        calls.append((method, args))
        return [["engine 0 worker 0", "engine 0 worker 1"], ["engine 1 worker 0", "engine 1 worker 1"]]

    client.call_utility_all_async = call_utility_all_async
    engine = object.__new__(AsyncLLM)
    engine.engine_core = client
    assert asyncio.run(engine.collective_rpc("m", timeout=5, args=(1,))) == ["engine 0 worker 0", "engine 0 worker 1"]
    assert asyncio.run(every_worker(engine, "m", 5, (1,))) == ["engine 0 worker 0", "engine 0 worker 1",
                                                               "engine 1 worker 0", "engine 1 worker 1"]
    assert calls == [("collective_rpc", ("m", 5, (1,), None))] * 2


def test_the_version_label_is_attached_after_the_pause_drained():
    """What the per-token versions rely on (reload.py switch_to labels the weights while paused),
    pinned on vLLM's engine core: a "keep" pause completes only once no batch is queued (async
    scheduling's batch in flight is drained first), and each step's outputs take the label the
    core holds when they are processed, after the model ran. So every output processed before
    the pause completed carries the old label, every one after it the new."""
    from collections import deque

    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    scheduler = object.__new__(Scheduler)
    scheduler._pause_state, scheduler.finished_req_ids = PauseState.UNPAUSED, set()
    scheduler.connector = scheduler.ec_connector = None
    core = object.__new__(EngineCoreProc)
    core.scheduler, core.engines_running, core._idle_state_callbacks = scheduler, False, []
    core.batch_queue = deque(["a batch in flight"])
    finished = []
    core._finish_pause = finished.append
    pending = core.pause_scheduler(mode="keep", clear_cache=False)
    # Held requests do not keep a "keep" pause from completing; the queued batch does.
    assert scheduler.get_num_unfinished_requests() == 0 and not scheduler.has_requests()
    assert pending is not None and not pending.done() and finished == []
    core.batch_queue.pop()  # its output processed (with the label still the old one)
    assert not core.has_work()
    core._notify_idle_state_callbacks()
    assert pending.done() and finished == [False]
    core.set_weight_version("7")
    outputs = {0: EngineCoreOutputs()}
    core._attach_weight_version(outputs)
    assert outputs[0].weight_version == "7"
    for step in (EngineCore.step, EngineCore.step_with_batch_queue):
        code = inspect.getsource(step)
        assert code.index("update_from_output(") < code.index("self._attach_weight_version("), step.__name__
