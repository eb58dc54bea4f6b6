"""The engine env of an attention rank as the system sees it (no Ray, no engine)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from afd_ray.attention.engine import engine_env
from afd_ray.config import AttentionPoolConfig

TITLED = """
import sys
from vllm.utils.system_utils import set_process_title
set_process_title("EngineCore")
print("titled", flush=True)
sys.stdin.read()
"""
"""A process that titles itself as vLLM's EngineCore does, then waits for stdin to close."""


def test_the_titled_engine_process_shows_its_engine_env() -> None:
    """`/proc/<pid>/environ` of a process titled `VLLM::EngineCore` holds every
    variable of `engine_env`: setproctitle would otherwise zero the environment
    strings to make room for the title (without `SPT_NOENV` nothing of it is left
    here, and the session app's engine showed only part of it, by variable order)."""
    env = engine_env(AttentionPoolConfig())
    with subprocess.Popen(
        [sys.executable, "-c", TITLED],
        env=os.environ | env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout.readline() == "titled\n"
            process = psutil.Process(child.pid)
            assert process.cmdline()[0] == "VLLM::EngineCore"
            shown = process.environ()
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    assert {name: shown.get(name) for name in env} == env
