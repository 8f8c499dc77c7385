"""Scale-out: two workers share one study in a real PostgreSQL server (started on loopback by .ci/postgres.sh).

Skips, saying why, when psycopg or the server is missing. The URL comes from HF_SCALE_TEST_POSTGRES_URL.
"""

import json
import os
import subprocess
import uuid

import optuna
import pytest

from tests.helpers import python_bin, start
from tests.hpo.conftest import WORKER

URL = os.environ.get("HF_SCALE_TEST_POSTGRES_URL", "postgresql://postgres:hpo-ci-password@127.0.0.1:55432/hpo")
N_TRIALS = 6


def server_reachable() -> str | None:
    """None when a server answers at URL, else why not."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]'), SQLAlchemy's PostgreSQL driver"
    try:
        psycopg.connect(URL, connect_timeout=3).close()
    except psycopg.OperationalError as error:
        return (
            f"no PostgreSQL server at HF_SCALE_TEST_POSTGRES_URL ({str(error).strip().splitlines()[0]}); "
            "source .ci/postgres.sh to start one"
        )
    return None


@pytest.mark.slow
def test_two_workers_share_one_study_without_running_a_trial_twice(tmp_path, tiny_model_dir):
    reason = server_reachable()
    if reason:
        pytest.skip(reason)
    study_name = f"scale-out-{uuid.uuid4().hex[:8]}"
    flags = ["--storage", URL, "--study_name", study_name, "--n_trials", str(N_TRIALS), "--startup_trials", "2"]
    workers = [
        start(
            [python_bin("python"), WORKER, "--output_dir", str(tmp_path / f"worker{index}"), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in (0, 1)
    ]
    try:
        outputs = [worker.communicate(timeout=500) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    try:
        study = optuna.load_study(study_name=study_name, storage=URL)
        trials = study.get_trials(deepcopy=False)
        reports = [json.loads((tmp_path / f"worker{index}" / "rank0.json").read_text()) for index in (0, 1)]
        started = [{outcome["number"] for outcome in report["outcomes"]} for report in reports]
        assert started[0] and started[1]  # both workers did work
        assert not started[0] & started[1]  # no trial ran twice
        assert started[0] | started[1] == {t.number for t in trials}  # the study holds every trial
        assert N_TRIALS <= len(trials) <= N_TRIALS + 1  # at most one extra when both start the last trial at once
        assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
        assert len({t.user_attrs["worker"] for t in trials}) == 2
        # The password never reaches a log line.
        password = URL.split(":")[2].split("@")[0]
        assert all(password not in out + err for out, err in outputs)
        assert "postgresql://postgres:***@127.0.0.1" in outputs[0][0] + outputs[1][0]
    finally:
        optuna.delete_study(study_name=study_name, storage=URL)
