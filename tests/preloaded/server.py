"""A Python that has imported torch, transformers, peft, datasets, optuna and hf_scale once, and forks a child per
launch: each launched test process starts in about 0.1 s instead of paying 5-8 CPU-seconds of imports.

`python tests/preloaded/server.py SOCKET EXECUTABLE` imports, then serves forever on the Unix socket SOCKET. Its client,
`tests/preloaded/python`, takes a `python` command line (`[-u] script args` or `[-u] -m module args`) and hands
it, with its working folder, environment and standard streams, to the server, which forks a child that runs the
program as `python` would. The client waits for the child and exits as it did (the same code, or killed by the
same signal), forwards the signals a launcher sends, and when the client itself is killed the server kills the
child's process group. In the child, `sys.executable` is EXECUTABLE (the client, in a bin folder that mirrors the
environment's: tests/preloaded/__init__.py), so what the program launches in turn
(torchrun's ranks, a search's workers, DeepSpeed's launcher) is forked from the server as well.

What a forked child shares with its siblings, unlike fresh interpreters: the modules imported before the fork
(their import-time reads of the environment come from the server's, which is the tests' launch environment) and
the string hash seed. Python's and numpy's random generators are reseeded per child.
See tests/README.md for which tests launch through it and which start real interpreters.
"""

from __future__ import annotations

import array
import io
import json
import os
import selectors
import signal
import socket
import struct
import sys

# What a launched test process imports on its way to training; imported once here, before any fork.
PRELOAD = (
    "torch",
    "torch.distributed.run",
    "transformers",
    "peft",
    "datasets",
    "accelerate.commands.launch",
    "optuna",
    "hf_scale.cli",
    "hf_scale.trainer",
    "hf_scale.recipes.finetune_llama2",
    "hf_scale.recipes.search_llama2",
    # what every recipe run's rank 0 draws its loss and learning-rate plots with (hf_scale.plotting): 0.5 s a run
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)
STATUS = struct.Struct("!i")  # the child's wait status, sent to the client when it ends


def receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """The client's request (a JSON object: argv, cwd, env, ...) and its standard streams' descriptors.

    The descriptors ride on the message's first bytes (SCM_RIGHTS): every read takes ancillary data, or they are lost.
    """
    fds = array.array("i")
    data = b""
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        chunk, ancillary, _, _ = connection.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
        if not chunk:
            raise EOFError("the client went away")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        data += chunk
    return json.loads(data[8:]), list(fds)


def as_fresh_python(request: dict, fds: list[int], client: str) -> None:
    """Make this forked process look like `python` just started with the request's command line."""
    os.setsid()  # its own process group: the server kills the group when the client dies
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python's own startup sets it
    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8", line_buffering=False)
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(
            raw, encoding="utf-8", errors=errors, line_buffering=os.isatty(fd) or fd == 2, write_through=unbuffered
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.__stdin__ = sys.stdin
    # The path a fresh interpreter would have: the script's folder (or the working folder for -m), then PYTHONPATH.
    inherited = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH_OF_SERVER", "").split(os.pathsep)]
    first = "" if request["module"] else os.path.dirname(os.path.realpath(request["argv"][0]))
    python_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *python_path, *inherited]
    sys.executable = client
    sys.orig_argv = [client, *request["python_args"]]
    import random

    import numpy
    import torch

    random.seed()
    numpy.random.seed()
    threads = request["env"].get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else os.cpu_count() or 1)


def run_program(request: dict) -> None:
    """Run the script or module as `__main__`, then exit as Python does (atexit handlers, flushed streams)."""
    import runpy

    try:
        if request["module"]:
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(request["argv"])
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit:
        raise
    except KeyboardInterrupt as error:
        print_from_the_program(error)
        sys.stdout.flush()
        sys.stderr.flush()
        import atexit

        atexit._run_exitfuncs()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException as error:
        print_from_the_program(error)
        sys.exit(1)
    sys.exit(0)


def print_from_the_program(error: BaseException) -> None:
    """The traceback a fresh interpreter prints: from the program's first frame, without this file's and runpy's."""
    import traceback

    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb)


def log_fork(request: dict) -> None:
    """One JSON line per forked program in HF_SCALE_TEST_LAUNCH_LOG, if set (tests/helpers.log_launch)."""
    if log := os.environ.get("HF_SCALE_TEST_LAUNCH_LOG"):
        program = request["module"] or os.path.basename(request["argv"][0])
        with open(log, "a") as file:
            file.write(json.dumps({"forked": program}) + "\n")


def parent_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 1


class Children:
    """The forked programs: each one's client connection, and the program it was launched from, if one of ours.

    A program's own launches (torchrun's ranks, a search's workers) are children of the server, not of the program,
    and torchrun starts its ranks in sessions of their own; so when a client is killed, its program is killed with
    every program launched under it, as killing a real process tree would."""

    def __init__(self) -> None:
        self.by_pidfd: dict[int, tuple[socket.socket, int]] = {}
        self.launched_from: dict[int, int] = {}  # pid -> pid of the program whose launch started it

    def add(self, pidfd: int, connection: socket.socket, pid: int, client_pid: int) -> None:
        self.by_pidfd[pidfd] = (connection, pid)
        ancestor = parent_pid(client_pid)
        running = {child for _, child in self.by_pidfd.values()}
        while ancestor > 1 and ancestor not in running:
            ancestor = parent_pid(ancestor)
        if ancestor > 1:
            self.launched_from[pid] = ancestor

    def remove(self, pidfd: int) -> tuple[socket.socket, int]:
        connection, pid = self.by_pidfd.pop(pidfd)
        self.launched_from.pop(pid, None)
        return connection, pid

    def kill_tree(self, pid: int) -> None:
        doomed = {pid}
        while grown := {child for child, parent in self.launched_from.items() if parent in doomed} - doomed:
            doomed |= grown
        for victim in doomed:
            try:
                os.killpg(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close_in_child(self) -> None:
        for pidfd, (connection, _) in self.by_pidfd.items():
            connection.close()
            os.close(pidfd)


def serve(path: str, executable: str) -> None:
    """Import, then serve on the Unix socket `path`; each child gets `executable` (the client) as sys.executable."""
    os.environ["PYTHONPATH_OF_SERVER"] = os.environ.get("PYTHONPATH", "")
    for module in PRELOAD:
        __import__(module)
    import gc

    gc.collect()
    gc.freeze()  # the imported objects are never traversed by a child's collector: fewer copy-on-write pages
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the path appears once the server accepts: clients wait for it
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    children = Children()

    def stop(*_) -> None:
        for _, pid in list(children.by_pidfd.values()):
            children.kill_tree(pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                connection, _ = listener.accept()
                client_pid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                try:
                    request, fds = receive_request(connection)
                except (EOFError, OSError, ValueError):
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    try:
                        children.close_in_child()
                        selector.close()
                        listener.close()
                        connection.close()
                        as_fresh_python(request, fds, executable)
                    except BaseException:
                        import traceback

                        traceback.print_exc()
                        os._exit(70)
                    run_program(request)  # never returns
                for fd in fds:
                    os.close(fd)
                log_fork(request)
                connection.sendall(STATUS.pack(pid))
                pidfd = os.pidfd_open(pid)
                children.add(pidfd, connection, pid, client_pid)
                selector.register(pidfd, selectors.EVENT_READ, "child")
                selector.register(connection, selectors.EVENT_READ, ("client", pidfd))
            elif key.data == "child":  # a program ended: its client gets the wait status
                connection, pid = children.remove(key.fd)
                _, status = os.waitpid(pid, 0)
                selector.unregister(key.fd)
                os.close(key.fd)
                if connection.fileno() in selector.get_map():
                    selector.unregister(connection)
                try:
                    connection.sendall(STATUS.pack(status))
                except OSError:
                    pass
                connection.close()
            else:  # the client's end became readable: it sends nothing after its request, so it went away
                selector.unregister(key.fd)
                if key.data[1] in children.by_pidfd:
                    children.kill_tree(children.by_pidfd[key.data[1]][1])


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
