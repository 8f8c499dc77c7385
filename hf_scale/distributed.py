"""Checks that the processes of a run really train together.

On a machine without an accelerator, transformers and accelerate can start a multi-process run that is
silently wrong: each process trains its own copy (world size 1 in every process), or a process group exists
but the model is never wrapped in DDP, so gradients are never averaged and the replicas drift apart. These
checks turn both into a clear error before or at the first step.
"""

from __future__ import annotations

import atexit
import os
import socket
import time

from torch import nn

from hf_scale.errors import DistributedSetupError

FIX = (
    "On a machine without an accelerator, multi-process training needs use_cpu=True (gloo DDP); "
    "ScaleTrainingArguments sets it for you unless auto_cpu_ddp=False."
)


def launched_world_size() -> int:
    """The number of processes the launcher (torchrun, accelerate, deepspeed) started, from `WORLD_SIZE`."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What a launcher (torchrun, accelerate launch, DeepSpeed's launcher) sets in each process it starts.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def single_process_launch_environment() -> dict[str, str]:
    """What a launcher gives one process: rank 0 of 1, a free local port."""
    return {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }  # fmt: skip


def set_single_process_launch_environment() -> bool:
    """Give a process that no launcher started what a launcher gives one process: rank 0 of 1, a free local port.

    DeepSpeed documents this for one GPU without its launcher (a notebook, `python train.py`). Without these
    variables DeepSpeed looks for MPI (`No module named 'mpi4py'`) or trains without a process group and fails at
    the first evaluation. A launcher's variables are left as they are; returns whether it set them.
    """
    if any(os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return False
    os.environ.update(single_process_launch_environment())
    return True


def release_gil_to_collectives_at_exit() -> None:
    """Let torch.distributed's worker threads finish their last collective before Python finalizes.

    A gloo worker thread destroys each collective's work object after the caller's `wait()` has returned; when
    Python has already dropped the work's tensors (transformers' `store_flos`, the last collective of
    `Trainer.train()`, gathers into a list it drops at once), that destruction needs the GIL. If the interpreter
    is finalizing by then, Python ends the thread inside a noexcept C++ destructor and the whole process aborts
    (SIGABRT, "terminate called without an active exception") after its work succeeded, and the job is
    reported failed. The core dump shows the thread: `c10d::ProcessGroupGloo::runLoop` ->
    `~AsyncAllgatherWork` -> `decref_pyobject` -> `take_gil` -> `pthread_exit`. Plain torch, 2 processes, an
    all_gather then exit: 8 aborts in 20 runs on a loaded 2-core machine. Sleeping at exit releases the GIL
    so that such a thread finishes first. Registered once, however many trainers a process builds; call it
    only in a process that has a process group.
    """
    # Whether a process group is still up at exit does not matter: `destroy_process_group` (accelerate's
    # end_training) leaves the groups' threads running while DeepSpeed or accelerate still hold the groups.
    atexit.unregister(_release_gil)
    atexit.register(_release_gil)


def _release_gil() -> None:
    # A waiting worker thread takes the GIL within a millisecond (measured); the margin is for a loaded machine.
    time.sleep(0.1)


def check_elastic_restarts() -> None:
    """Refuse `torchrun --max_restarts N` where the restarted workers would hang instead of resuming.

    When the workers share the launcher's rendezvous store (TORCHELASTIC_USE_AGENT_STORE=True, the default),
    a restarted attempt reads the dead attempt's addresses from it and waits in `init_process_group` until
    the timeout (gloo here, measured; NCCL in pytorch/pytorch#135712). With its own store per attempt the
    restart works: tests/distributed/test_kills_during_saves.py restarts a ZeRO-2 job 20 times this way.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise DistributedSetupError(
            f"torchrun --max_restarts {restarts} with the workers sharing the launcher's store: a restarted "
            "worker would hang in init_process_group on the failed attempt's addresses. Launch with "
            "`--rdzv_backend c10d --rdzv_endpoint HOST:PORT` and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the "
            "environment, or without --max_restarts."
        )


def check_process_group(world_size: int, distributed_type: str) -> None:
    """Refuse a run whose processes would not train together.

    `world_size` is what the Trainer sees, `distributed_type` accelerate's mode (e.g. "MULTI_CPU", "NO").
    """
    launched = launched_world_size()
    if launched > 1 and world_size != launched:
        raise DistributedSetupError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but this process sees world "
            f"size {world_size}: each process would train its own model. {FIX}"
        )
    if world_size > 1 and distributed_type == "NO":
        raise DistributedSetupError(
            f"world size is {world_size} but accelerate's distributed mode is NO: the model would not be "
            f"wrapped for data parallel training and the replicas would drift apart. {FIX}"
        )


def check_model_is_wrapped(model: nn.Module, world_size: int) -> None:
    """Refuse to take a training step when several processes train a model that nothing synchronises."""
    if world_size <= 1:
        return
    wrapper = type(model).__name__
    if wrapper not in {"DistributedDataParallel", "DeepSpeedEngine", "FullyShardedDataParallel"} and not hasattr(
        model, "_fsdp_wrapped_module"
    ):
        raise DistributedSetupError(
            f"world size is {world_size} but the model being trained is a plain {wrapper}, not wrapped for "
            "distributed training: gradients would not be averaged across processes. Known causes: no "
            "accelerator and use_cpu unset (ScaleTrainingArguments sets it unless auto_cpu_ddp=False); "
            "the stock Trainer's evaluate() called before train() (ScaleTrainer undoes that)."
        )
