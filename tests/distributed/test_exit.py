"""A process of a finished multi-process run exits 0, not SIGABRT at interpreter exit (issue 17, item 5)."""

import os
import subprocess
import sys

import pytest

from tests.helpers import start, torchrun

pytestmark = pytest.mark.slow

# The abort needs a gloo worker thread that gets the CPU late, after the interpreter started finalizing: without
# the fix, about a third of these launches aborted on a loaded 2-core machine (8 of 20 with one busy process
# beside them), so 8 launches fail with a probability above 0.9 when it is broken.
ROUNDS, CONCURRENT = 4, 2


def test_processes_exit_cleanly_after_their_last_collective():
    # The load CI's other jobs bring: in the suite the other pytest workers bring it (a load average of 4-6 on the
    # 2 cores), run alone this test makes it.
    loaded = os.getloadavg()[0] >= 2
    busy = None if loaded else subprocess.Popen([sys.executable, "-c", "while True: pass"])
    failures = []
    try:
        for _ in range(ROUNDS):
            launches = [
                start(
                    torchrun("tests/distributed/exit_worker.py", "--release-gil-at-exit"),
                    fresh=True,  # forked from the preloaded server, 10 launches without the fix never aborted (2 fresh)
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(CONCURRENT)
            ]
            for launch in launches:
                _, stderr = launch.communicate(timeout=120)
                if launch.returncode != 0:
                    failures.append([line for line in stderr.splitlines() if "terminate" in line or "exitcode" in line])
    finally:
        if busy is not None:
            busy.kill()
    assert not failures, f"{len(failures)} of {ROUNDS * CONCURRENT} launches failed; the first:\n{failures[0]}"
