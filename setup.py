"""Maps the repo-root folders onto the `corectl` namespace (pyproject.toml holds the metadata).

`core/` is the `corectl` package itself; `backends/`, `plugins/` and `server/` become its subpackages.
Subpackages are discovered so that adding a folder never needs an edit here.
"""
from setuptools import find_packages, setup

ROOTS = {
    "corectl": "core",
    "corectl.backends": "backends",
    "corectl.plugins": "plugins",
    "corectl.server": "server",
}


def _packages() -> list[str]:
    found = []
    for package, folder in ROOTS.items():
        found.append(package)
        found.extend(f"{package}.{sub}" for sub in find_packages(folder))
    return found


setup(packages=_packages(), package_dir=ROOTS)
