from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "models" / "tiny-reverse"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rl_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rl", *args]


@pytest.fixture
def write_toml(tmp_path):
    def write(text: str, name: str = "cfg.toml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
