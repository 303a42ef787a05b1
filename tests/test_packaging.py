"""The built wheel is a working corectl without the source tree: the folder-to-package mapping
(core/ -> corectl, backends/ -> corectl.backends, ...) holds, and its entry points resolve."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# installed package folder -> source folder, as setup.py maps them
PACKAGE_DIRS = {"corectl": "core", "corectl/backends": "backends", "corectl/plugins": "plugins",
                "corectl/server": "server"}

# Runs with only the installed wheel and the venv's third-party packages importable.
CHECK_SCRIPT = """
import importlib, sys
from importlib import metadata
from pathlib import Path

target = Path(sys.argv[1]).resolve()
for name in ("corectl", "corectl.backends.cpu", "corectl.plugins", "corectl.server", "corectl.server.cli"):
    module = importlib.import_module(name)
    assert target in Path(module.__file__).resolve().parents, f"{name} imported from {module.__file__}"
dist = metadata.distribution("corectl")
assert Path(dist.locate_file("")).resolve() == target, dist.locate_file("")
eps = {ep.name: ep for ep in metadata.entry_points(group="corectl")}
assert {"cpu", "cuda", "rocm", "models"} <= eps.keys(), sorted(eps)
for ep in eps.values():
    assert Path(ep.dist.locate_file("")).resolve() == target, (ep.name, ep.dist.locate_file(""))
    ep.load()
(script,) = [ep for ep in dist.entry_points if ep.group == "console_scripts" and ep.name == "corectl"]
sys.exit(script.load()(["plugins"]))
"""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the checkout (so build/ and egg-info stay out of it) and
    install it, without dependencies, into a folder of its own."""
    root = tmp_path_factory.mktemp("packaging")
    source = shutil.copytree(REPO, root / "source", ignore=_ignore_top_level_extras)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
          str(source), "-w", str(root / "dist")])
    (wheel,) = (root / "dist").glob("corectl-*.whl")
    target = root / "site"
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target),
          str(wheel)])
    return target


def _ignore_top_level_extras(folder: str, names: list[str]) -> set[str]:
    build_outputs = {n for n in names if n in ("build", "dist", "__pycache__") or n.endswith(".egg-info")}
    if Path(folder) == REPO:
        # Hidden folders (git, caches, peer harnesses) and tests are not part of the package.
        build_outputs |= {n for n in names if n.startswith(".") or n in ("tests", "examples")}
    return build_outputs


def test_wheel_holds_every_package(installed_wheel):
    installed = {p.relative_to(installed_wheel).parent for p in installed_wheel.rglob("__init__.py")}
    expected = {
        Path(package) / init.relative_to(REPO / folder).parent
        for package, folder in PACKAGE_DIRS.items()
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert expected - installed == set()


def test_wheel_imports_and_lists_plugins_without_the_source_tree(installed_wheel, tmp_path):
    # -S skips site-packages' .pth files, and with them the editable install pointing at this
    # checkout; the venv's site-packages still comes after the wheel for torch and friends.
    site_packages = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed_wheel), site_packages])}
    out = _run([sys.executable, "-S", "-c", CHECK_SCRIPT, str(installed_wheel)], cwd=tmp_path, env=env).stdout
    rows = {tuple(line.split()[:4]) for line in out.splitlines()}
    assert ("platform", "cpu", "cpu", "corectl") in rows, out
    assert ("model", "LlamaForCausalLM", "models", "corectl") in rows, out


def test_wheel_ships_the_dashboard_page(installed_wheel):
    static = installed_wheel / "corectl" / "server" / "http" / "dashboard_static"
    assert sorted(p.name for p in static.iterdir()) == ["dashboard.css", "dashboard.js", "index.html"]
