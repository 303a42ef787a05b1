"""The house rules of docs/architecture.md section 1, checked on the source with `ast`.

Every module under core/, backends/, plugins/ and server/ is parsed (found by walking the folders,
so moving files needs no edit here) and every import is read: module level and inside functions
(lazy imports), relative ones resolved to full `corectl.*` names, `from pkg import mod` counted as
an import of `pkg.mod`. An import under `if TYPE_CHECKING:` runs only for the type checker: it
counts for the "who may import whom" rules but not for cycles or floors (an annotation may name a
type from above, e.g. `Platform.worker_cls` returns a `Worker`). Importing `a.b.c` also runs the
`__init__` of `a` and `a.b`; those implicit edges are not added (every package would then sit in a
cycle with its children).
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Folder -> the package it installs as (setup.py's ROOTS).
ROOTS = {"core": "corectl", "backends": "corectl.backends", "plugins": "corectl.plugins", "server": "corectl.server"}
CORE_EXCLUDES = ("corectl.backends", "corectl.plugins", "corectl.server")

# The floors of core, lowest first. A module sits on the floor of the longest prefix naming it
# (`corectl` alone names only the package's own __init__); it may import its own floor and the ones
# below. Where a package spans floors, the exception is its message or config module, which the
# floors below it need.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("contracts", (
        "corectl.errors", "corectl.envs", "corectl.lazy_exports", "corectl.process_exit", "corectl.sampling_params", "corectl.pooling",
        "corectl.config", "corectl.request", "corectl.outputs", "corectl.attention", "corectl.platform",
        "corectl.compilation", "corectl.json_option",  # an EngineConfig field; the JSON options' decoder
        "corectl.discovery", "corectl.tokenizer", "corectl.detokenizer", "corectl.step_messages",
        "corectl.chat_content",         # how message content reaches the tokenizer's chat template
        "corectl.lora.request",         # a request's adapter, carried by Request and NewRequestData
        "corectl.spec_decode.config",   # an EngineConfig field
        "corectl.kv_transfer.config",   # EngineConfig.kv_transfer_config, SamplingParams.kv_transfer_params
        "corectl.multimodal.inputs",    # a request's images, carried by Request and NewRequestData
    )),
    ("parts", ("corectl.distributed", "corectl.kv", "corectl.kv_transfer",
               "corectl.sample", "corectl.structured", "corectl.loaders",
               "corectl.multimodal")),
    ("quantization", ("corectl.quantization",)),
    ("models", ("corectl.models",)),
    ("worker", ("corectl.worker", "corectl.lora", "corectl.spec_decode")),
    ("scheduler", (
        "corectl.scheduler",
        "corectl.engine.messages",      # EngineCoreOutput and SchedulerStats: the scheduler writes them
    )),
    ("executor", ("corectl.executor",)),
    ("engine", ("corectl.engine",)),
    ("api", ("corectl", "corectl.llm", "corectl.beam_search", "corectl.generation_config", "corectl.planning",
             "corectl.planning_weights", "corectl.planning_drafts")),
]

# (importer, imported, why) imports that break the floors on purpose. Keep it short.
FLOOR_EXCEPTIONS: list[tuple[str, str, str]] = []

# Packages that must not import each other, in either direction, whatever their floors.
SIBLINGS_APART = [("corectl.scheduler", "corectl.worker", "the two exchange corectl.step_messages only")]

# Names of platforms and torch device types; core asks `Platform` instead of naming one.
DEVICE_NAMES = {"cpu", "cuda", "rocm", "hip", "xpu", "mps", "tpu", "npu", "hpu", "gpu"}
# (module, literal, why) device names core may write. Keep it short.
DEVICE_LITERAL_EXCEPTIONS = [
    # Checkpoint files are mapped on the host and copied to each parameter's own device.
    ("corectl.loaders.checkpoint_files", "cpu", "safetensors maps the file on the host"),
    # `corectl plan --device cpu|gpu` names a target class, not a platform (planning.DEVICES).
    ("corectl.planning", "cpu", "the --device choice 'cpu'"),
    ("corectl.planning", "gpu", "the --device choice 'gpu'"),
    # Ray's own resource names: actor options take its CPU and GPU counts as keywords.
    ("corectl.executor.ray_executor", "CPU", "Ray's num_cpus"),
    ("corectl.executor.ray_executor", "GPU", "Ray's num_gpus"),
]


@dataclass(frozen=True)
class Import:
    target: str
    line: int
    type_only: bool


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: list[Import]


def _module_name(folder: str, path: Path) -> str:
    parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOTS[folder], *parts])


@functools.cache
def _modules() -> dict[str, Module]:
    """Every module of the tree, parsed on first use (at test time, not when pytest collects this file in
    every worker: the parse costs seconds)."""
    modules: dict[str, Module] = {}
    for folder in ROOTS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            name = _module_name(folder, path)
            modules[name] = Module(name, path, tree, [])
    for module in modules.values():
        module.imports = _imports(module, modules)
    return modules


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _imports(module: Module, modules: dict[str, Module]) -> list[Import]:
    type_only = _type_checking_nodes(module.tree)
    is_package = module.path.name == "__init__.py"
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.name.split(".")[: len(module.name.split(".")) - node.level + is_package]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
        else:
            continue
        for target in targets:
            if target == "corectl" or target.startswith("corectl."):
                found.append(Import(_known(target, modules), node.lineno, id(node) in type_only))
    return found


def _known(target: str, modules: dict[str, Module]) -> str:
    """The module a dotted import name runs (`corectl.x.Name` -> `corectl.x`)."""
    while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
    return target



def _fail_on(found: list[str], rule: str) -> None:
    """Fail with the rule and one line per place that breaks it (no traceback: the lines say it)."""
    if found:
        pytest.fail(f"{rule}:\n" + "\n".join(found), pytrace=False)


def _where(module: Module, imp: Import) -> str:
    return f"{module.path.relative_to(REPO)}:{imp.line}"


def _in(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_core(name: str) -> bool:
    return _in(name, "corectl") and not any(_in(name, p) for p in CORE_EXCLUDES)


def _violations(rule) -> list[str]:
    return [f"  {_where(m, imp)}: {m.name} imports {imp.target}" for m in _modules().values()
            for imp in m.imports if rule(m.name, imp.target)]


def test_the_walk_finds_every_layer():
    for root in ("corectl.engine.core", "corectl.backends", "corectl.plugins.manager", "corectl.server"):
        assert root in _modules(), f"{root} not found: did the folder layout change?"


def test_no_import_cycle():
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for module in _modules().values():
        for imp in module.imports:
            if not imp.type_only and imp.target != module.name:
                graph[module.name].setdefault(imp.target, imp)
    cycles = [_cycle_in(component, graph) for component in _strongly_connected(graph) if len(component) > 1]
    report = "\n".join(" -> ".join(cycle) + "\n" + "\n".join(
        f"    {_where(_modules()[a], graph[a][b])}: {a} imports {b}" for a, b in zip(cycle, cycle[1:]))
        for cycle in cycles)
    _fail_on([report] if cycles else [], "import cycles (break each by moving the shared piece one floor down)")


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is deeper than Python's recursion limit allows)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(_modules()):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycle_in(component: list[str], graph: dict[str, dict[str, Import]]) -> list[str]:
    """One shortest cycle through the component's first module (breadth first), start repeated at the end."""
    start, members = component[0], set(component)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def test_core_imports_neither_backends_nor_server():
    found = _violations(lambda src, dst: _is_core(src) and (_in(dst, "corectl.backends") or _in(dst, "corectl.server")))
    _fail_on(found, "core must not import a backend or the server (backends plug in through corectl.plugins)")


def test_backends_do_not_import_the_server():
    found = _violations(lambda src, dst: _in(src, "corectl.backends") and _in(dst, "corectl.server"))
    _fail_on(found, "backends must not import the server")


def test_plugins_import_nothing_of_ours():
    found = _violations(lambda src, dst: _in(src, "corectl.plugins") and not _in(dst, "corectl.plugins"))
    _fail_on(found, "corectl.plugins (hookspecs, specs, the manager) must import nothing of ours")


def test_only_the_plugin_manager_reads_entry_points():
    found = []
    for module in _modules().values():
        if module.name == "corectl.plugins.manager":
            continue
        for node in ast.walk(module.tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
                " ".join(a.name for a in node.names) if isinstance(node, ast.ImportFrom) else ""
            if "entry_points" in name:
                found.append(f"  {module.path.relative_to(REPO)}:{node.lineno}: {name}")
    _fail_on(found, "only plugins/manager.py reads entry points (everything else asks the manager)")


def _floor(name: str) -> int:
    best, floor = "", None
    for number, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            matches = name == prefix if prefix == "corectl" else _in(name, prefix)
            if matches and len(prefix) > len(best):
                best, floor = prefix, number
    if floor is None:
        raise AssertionError(f"{name} sits on no floor: add it (or its package) to FLOORS in {Path(__file__).name}")
    return floor


def test_core_imports_only_downwards():
    allowed = {(src, dst) for src, dst, _ in FLOOR_EXCEPTIONS}
    found = []
    for module in _modules().values():
        if not _is_core(module.name):
            continue
        for imp in module.imports:
            if imp.type_only or not _is_core(imp.target) or (module.name, imp.target) in allowed:
                continue
            src, dst = _floor(module.name), _floor(imp.target)
            apart = any(_in(module.name, a) and _in(imp.target, b) or _in(module.name, b) and _in(imp.target, a)
                        for a, b, _ in SIBLINGS_APART)
            if dst > src or apart:
                found.append(f"  {_where(module, imp)}: {module.name} ({FLOORS[src][0]}) imports {imp.target} "
                             f"({FLOORS[dst][0]})")
    _fail_on(found, "core imports only its own floor and the ones below (FLOORS, lowest first; "
                    "SIBLINGS_APART; FLOOR_EXCEPTIONS)")


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


@pytest.mark.parametrize("kind", ["literal", "environment", "torch module"])
def test_core_names_no_device(kind):
    """Core asks `Platform` (device_for_rank, confine_process_env, ray_resources_per_rank, ...)
    instead of naming a platform, a device type or a device runtime's environment variable."""
    allowed = {(module, literal) for module, literal, _ in DEVICE_LITERAL_EXCEPTIONS}
    found = []
    for module in _modules().values():
        if not _is_core(module.name):
            continue
        skip = _docstrings(module.tree)
        for node in ast.walk(module.tree):
            if kind == "literal" and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in skip and node.value.lower() in DEVICE_NAMES \
                    and (module.name, node.value) not in allowed:
                found.append(f"  {module.path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
            elif kind == "environment" and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in skip and node.value.upper().startswith(("CUDA_", "HIP_", "ROCR_", "ZE_")):
                found.append(f"  {module.path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
            elif kind == "torch module" and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "torch" and node.attr.lower() in DEVICE_NAMES:
                found.append(f"  {module.path.relative_to(REPO)}:{node.lineno}: torch.{node.attr}")
    _fail_on(found, f"core names a device ({kind}); ask the Platform, or add a commented "
                    "DEVICE_LITERAL_EXCEPTIONS entry")
