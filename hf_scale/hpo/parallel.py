"""`parallel_trials`: K trials at once on one node, each by its own worker, all on one study.

The process the user starts becomes the launcher: it starts K workers, each the same program with the same arguments
on its share of the node (on GPU, world_size/K devices through CUDA_VISIBLE_DEVICES, under torchrun when that share
is more than one device; on CPU, one process each). Each worker runs trials until the study holds n_trials, then
exits without reloading or reporting; the launcher then reloads the best trial into its trainer and writes the one
report. A worker that dies in the middle of a trial (killed, out of memory) gets its trial marked failed at once (and
queued again, as a dead worker's trial is in any shared study) and its place is taken by a new worker; Ctrl-C stops
every worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState
from transformers.integrations import is_deepspeed_zero3_enabled

from hf_scale.distributed import LAUNCHER_VARIABLES, free_port, single_process_launch_environment
from hf_scale.errors import ConfigError, HfScaleError
from hf_scale.hpo.storage import fail_trial, quiet_experimental

# Set by the launcher in each worker's environment: which worker this is ("slot.start", e.g. "1.0", then "1.1" for the
# worker that takes its place). A process with it runs trials only; one without it and parallel_trials > 1 launches.
WORKER_ENV = "HF_SCALE_SEARCH_WORKER"
JOURNAL_FILE = "optuna_journal.log"
POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 30


def worker_id() -> str | None:
    """This process's worker of a parallel search, or None when it is not one."""
    return os.environ.get(WORKER_ENV)


def check_launched_alone(parallel_trials: int) -> None:
    """A parallel search must be started as one process: it starts its workers itself."""
    if parallel_trials > 1 and worker_id() is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"parallel_trials={parallel_trials}: the search starts its own workers; start it as one process "
            "(hf-scale search, python), not under torchrun or accelerate launch"
        )


def check_can_launch(parallel_trials: int, retrain_best: bool, zero3: bool) -> list[list[str]] | None:
    """The device share of each worker (None on CPU: one process each); a ConfigError before any worker starts."""
    check_launched_alone(parallel_trials)
    if "ipykernel" in sys.modules:
        raise ConfigError("parallel_trials: each worker re-runs this program; run the search as a script, not here")
    import torch

    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(index) for index in range(torch.cuda.device_count())]
    if len(devices) % parallel_trials:
        raise ConfigError(
            f"parallel_trials={parallel_trials}: this node has {len(devices)} GPU(s), which do not split evenly"
        )
    share = len(devices) // parallel_trials
    if share > 1 and (retrain_best or zero3):
        raise ConfigError(
            f"parallel_trials={parallel_trials} with {share} GPUs per trial: the best trial is reloaded by one "
            "process, so it cannot be trained again (retrain_best, ZeRO-3); search without parallel_trials"
        )
    return [devices[index * share : (index + 1) * share] for index in range(parallel_trials)]


def worker_command(devices: list[str] | None) -> list[str]:
    """This program again, with its arguments: itself on one device or CPU, under torchrun on several."""
    # sys.orig_argv is the interpreter's own command line: the interpreter and its options, the script (or -m and
    # the module), then sys.argv[1:].
    program = sys.orig_argv[1 : len(sys.orig_argv) - len(sys.argv) + 1]
    if devices is None or len(devices) == 1:
        return [sys.executable, *program, *sys.argv[1:]]
    target = program[-2:] if len(program) >= 2 and program[-2] == "-m" else program[-1:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(len(devices))]
    return [*torchrun, "--master_port", str(free_port()), *target, *sys.argv[1:]]


@dataclass
class Worker:
    slot: int
    devices: list[str] | None
    starts: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.slot}.{self.starts - 1}"

    def start(self, parallel_trials: int) -> None:
        env = worker_environment(self.devices, parallel_trials)
        env[WORKER_ENV] = f"{self.slot}.{self.starts}"
        self.starts += 1
        # Its own process group: a terminal's Ctrl-C reaches the launcher alone, which stops each worker once.
        self.process = subprocess.Popen(worker_command(self.devices), env=env, process_group=0)


def worker_environment(devices: list[str] | None, parallel_trials: int) -> dict[str, str]:
    """The launcher's environment for a worker on `devices` (None: CPU), one of `parallel_trials`.

    A worker is a launch of its own: it does not inherit the launcher's rank variables (which a one-process ZeRO
    run sets, port included; two workers on one port fail with EADDRINUSE). A one-process worker gets rank 0 of 1
    on a port of its own where the launcher had such variables (DeepSpeed needs them); torchrun sets them for a
    worker on several devices. On CPU the cores are split between the workers, which would each use all of them.
    """
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    if (devices is None or len(devices) == 1) and os.environ.get("WORLD_SIZE") == "1":
        env.update(single_process_launch_environment())
    if devices is None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // parallel_trials))
    return env


def fail_trials_of(study: optuna.Study, storage: optuna.storages.BaseStorage, worker: str, retry: Any) -> list[int]:
    """Mark FAIL the trials `worker` left running (queued again through `retry` unless None); their numbers."""
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    left = [trial.number for trial in running if trial.user_attrs.get("parallel_worker") == worker]
    return [number for number in left if fail_trial(study, storage, number, retry)]


def run_workers(study: optuna.Study, storage: optuna.storages.BaseStorage, settings: Any, say: Any) -> str:
    """Start the workers, keep their number up while trials are left, and wait for all; what ended them."""
    groups = check_can_launch(settings.parallel_trials, settings.retrain_best, is_deepspeed_zero3_enabled())
    with quiet_experimental():
        retry = RetryHeartbeatStaleTrialCallback(max_retry=settings.max_retry)
    workers = [Worker(slot, None if groups is None else groups[slot]) for slot in range(settings.parallel_trials)]
    for worker in workers:
        worker.start(settings.parallel_trials)
    share = "one process" if groups is None else f"{len(groups[0])} GPU(s)"
    say(f"{len(workers)} workers started, each on {share}, on one study")
    exits, any_succeeded = [], False
    # A scheduler's preemption or `kill` stops the workers as Ctrl-C does, instead of leaving them on the GPUs.
    in_main_thread = threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    previous_handler = signal.signal(signal.SIGTERM, raise_terminated) if in_main_thread else None
    try:
        while running := [worker for worker in workers if worker.process is not None]:
            time.sleep(POLL_SECONDS)
            for worker in running:
                code = worker.process.poll()
                if code is None:
                    continue
                worker.process = None
                if code == 0:
                    any_succeeded = True
                    continue
                failed = fail_trials_of(study, storage, worker.name, retry)
                exits.append(f"worker {worker.name} exited with code {code}")
                if failed:
                    say(f"worker {worker.name} died (exit code {code}) in trial(s) {failed}: marked failed")
                    if worker.starts <= settings.max_retry:
                        worker.start(settings.parallel_trials)
                        say(f"worker {worker.name} takes its place")
                else:
                    say(f"worker {worker.name} exited with code {code}")
    except BaseException:  # Ctrl-C, or the launcher itself failing: no worker is left behind
        stop_all(workers)
        for worker in workers:
            fail_trials_of(study, storage, worker.name, retry=None)
        raise
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    if not any_succeeded:
        raise HfScaleError(f"every worker of the search failed: {'; '.join(exits)}")
    return f"every worker ended ({'; '.join(exits)})" if exits else "every worker ended"


class Terminated(SystemExit):
    """SIGTERM reached the launcher: it exits with 143 (128 + SIGTERM, as the signal would) once the workers end."""


def raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def stop_all(workers: list[Worker]) -> None:
    """Ctrl-C: each worker gets SIGINT (its trial is recorded failed); one that does not end in time is killed."""
    running = [worker.process for worker in workers if worker.process is not None]
    for process in running:
        process.send_signal(signal.SIGINT)
    deadline = time.time() + STOP_GRACE_SECONDS
    for process in running:
        try:
            process.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
