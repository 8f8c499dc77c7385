"""The tests' preloaded launcher (server.py and its client `python`): one server per pytest process, started on first
use, stopped at exit; HF_SCALE_TEST_PRELOADED=0 turns it off (every launch then starts a fresh interpreter).

Beside the server lies a bin folder that mirrors this environment's: `python` is the client, each console script
(torchrun, accelerate, deepspeed, hf-scale) a two-line wrapper that hands the script to the client, everything else a
link. It is the forked programs' `sys.executable`, so a program that finds its tools beside its interpreter
(`Path(sys.executable).parent / "torchrun"`) finds them there, preloaded too.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CLIENT = Path(__file__).resolve().parent / "python"
SERVER = Path(__file__).resolve().parent / "server.py"
ENVIRONMENT_BIN = Path(sys.executable).parent
STARTUP_SECONDS = 300  # its imports take 5-20 s; more on a loaded machine


def enabled() -> bool:
    return os.environ.get("HF_SCALE_TEST_PRELOADED", "1") != "0"


def is_interpreter(executable: str | Path) -> bool:
    path = Path(executable)
    return path.parent == ENVIRONMENT_BIN and path.name.startswith("python")


def is_console_script(executable: str | Path) -> bool:
    """A Python script of this environment's bin folder: its first line starts this environment's interpreter."""
    path = Path(executable)
    if path.parent != ENVIRONMENT_BIN or not path.is_file() or is_interpreter(path):
        return False
    with path.open("rb") as file:
        shebang = file.readline().decode(errors="replace").removeprefix("#!").split()
    return bool(shebang) and is_interpreter(shebang[0])


@dataclass
class Server:
    socket: str
    bin: Path  # the mirrored bin folder


_server: Server | None = None


def mirrored_bin(folder: Path) -> Path:
    folder.mkdir()
    for entry in ENVIRONMENT_BIN.iterdir():
        target = folder / entry.name
        if is_interpreter(entry):
            target.symlink_to(CLIENT)
        elif is_console_script(entry):
            target.write_text(f'#!/bin/sh\nexec "{CLIENT}" "{entry}" "$@"\n')
            target.chmod(0o755)
        else:
            target.symlink_to(entry)
    return folder


def server(server_env: dict[str, str]) -> Server:
    """The running server; started on first use with `server_env`, the launch environment its imports read."""
    global _server
    if _server is None:
        folder = Path(tempfile.mkdtemp(prefix="hf-scale-preloaded-"))
        bin_folder, socket = mirrored_bin(folder / "bin"), str(folder / "socket")
        log = open(folder / "server.log", "w")  # noqa: SIM115 -- the server's, for the life of the run
        process = subprocess.Popen(
            [sys.executable, str(SERVER), socket, str(bin_folder / "python")], env=server_env, stdout=log, stderr=log
        )
        atexit.register(process.terminate)
        deadline = time.monotonic() + STARTUP_SECONDS
        while not os.path.exists(socket):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the preloaded server did not start: {(folder / 'server.log').read_text()[-3000:]}")
            time.sleep(0.05)
        _server = Server(socket, bin_folder)
    return _server


def command(args: list[str], env: dict[str, str], server_env: dict[str, str]) -> list[str]:
    """`args` through the preloaded client when they start a Python program of this environment, else as they are;
    `env` (the launch's environment) gets the client's two variables.

    `python -c CODE` goes to the client too, which runs it in a fresh interpreter: such code simulates a machine
    without some package, which a process that has imported them cannot."""
    if not enabled() or not (is_interpreter(args[0]) or is_console_script(args[0])):
        return args
    running = server(server_env)
    env["HF_SCALE_PRELOADED"] = running.socket
    env["HF_SCALE_REAL_PYTHON"] = sys.executable
    return [str(running.bin / Path(args[0]).name), *args[1:]]
