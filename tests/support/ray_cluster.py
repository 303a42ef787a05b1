"""A local Ray cluster for executor tests: its own short temp dir (Ray's socket paths must stay
short), no auth and no dashboard, and RAY_ADDRESS unset so the engine joins this one."""
from __future__ import annotations

import contextlib
import shutil
import tempfile

import pytest


@contextlib.contextmanager
def local_ray_cluster(num_cpus: int = 2):
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.delenv("RAY_ADDRESS", raising=False)
        ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir)
        try:
            yield ray
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
