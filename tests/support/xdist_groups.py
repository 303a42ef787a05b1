"""pytest-xdist scheduling that keeps each session server on one worker.

`--dist loadscope` hands whole modules to workers, so a session-scoped server (tests/server/conftest.py,
support/server_a_fixtures.py) starts once on every worker that happens to run one of its modules and
lives until that worker ends: on 2 workers, two copies of each, some 1.5 GB of RAM apiece (API and engine
processes) and ~15 s of CPU to start. Here the modules that use the same session server form one scope,
found by reading each module's function signatures (tests and fixtures) for the servers' fixture names, so
each server starts once per run. A module that uses two servers joins their groups into one."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

# Fixture name -> the session server it starts or reads (fixtures of tests/server/: its conftest and
# support/server_a_fixtures, which only modules there take).
SESSION_SERVERS = {
    "server": "server", "http": "server", "openai_client": "server", "model_id": "server",
    "keyless_server": "keyless", "pooling_server": "pooling", "pooling_http": "pooling",
    "tools_server": "tools",
}
SERVER_TESTS = "tests/server/"


@functools.cache
def servers_of(module: Path) -> frozenset[str]:
    """The session servers a test module's functions (tests and fixtures) take as arguments; a name
    the module defines itself is its own fixture, not the session one."""
    try:
        tree = ast.parse(module.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    names = {arg.arg for node in functions for arg in node.args.args + node.args.kwonlyargs}
    names -= {node.name for node in functions}
    return frozenset(SESSION_SERVERS[name] for name in names & SESSION_SERVERS.keys())


def server_scopes(modules: set[str], rootdir: Path) -> dict[str, str]:
    """module -> its scope, for the modules that use a session server: the modules linked through
    shared servers (a module using two servers links them) form one scope."""
    parent: dict[str, str] = {}

    def find(server: str) -> str:
        while parent.setdefault(server, server) != server:
            server = parent[server]
        return server

    uses = {module: servers_of(rootdir / module) for module in modules if module.startswith(SERVER_TESTS)}
    for servers in uses.values():
        ordered = sorted(servers)
        for server in ordered[1:]:
            parent[find(server)] = find(ordered[0])
    return {module: f"session-server:{find(min(servers))}" for module, servers in uses.items() if servers}


class SessionServerScheduling(LoadScopeScheduling):
    """loadscope, with the modules of a session server's group in one scope."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self._scopes: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._scopes is None:  # schedule() calls this once the collection is complete
            modules = {test.split("::", 1)[0] for test in self.collection}
            self._scopes = server_scopes(modules, Path(self.config.rootpath))
        return self._scopes.get(nodeid.split("::", 1)[0]) or super()._split_scope(nodeid)
