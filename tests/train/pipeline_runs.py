"""Helpers to run train/pod.py in subprocesses (plain python or the deepspeed launcher) for the tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pipeline_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    python_path = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(PATH=f"{VENV_BIN}:{env.get('PATH', '')}", DS_ACCELERATOR="cpu", PYTHONPATH=python_path,
               TORCH_EXTENSIONS_DIR=str(Path(sys.prefix) / ".torch_extensions"), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def deepspeed_command(recipe: Path, *args: str, processes: int = 2) -> list[str]:
    return [str(VENV_BIN / "deepspeed"), "--num_gpus", str(processes), "--master_port", str(free_port()),
            str(REPO / "train" / "pod.py"), str(recipe), *args]


def python_command(recipe: Path, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "train" / "pod.py"), str(recipe), *args]


def run(command: list[str], env: dict, timeout: int = 400) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}\n--- stdout\n{done.stdout[-6000:]}\n"
                             f"--- stderr\n{done.stderr[-6000:]}")
    return done
