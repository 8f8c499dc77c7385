"""The installed package is the product: the wheel, installed into a fresh environment, works from an empty folder.

The fresh environment gets the wheel (no editable link to this clone) and sees the test environment's
dependencies (torch, transformers, DeepSpeed...) through a plain path entry, whose .pth files, the editable link
among them, Python does not read: `import hf_scale` can only find the wheel's copy.
"""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, free_port, launch_env, run_once

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def installed(shared_dir) -> Path:
    """The bin/ folder of a fresh environment that has the hf_scale wheel installed (built once per test run: two
    builds at once would share the clone's build/ folder)."""
    return run_once(shared_dir, "package", build_and_install) / "environment" / "bin"


def build_and_install(root: Path) -> None:
    wheels, environment = root / "wheels", root / "environment"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    subprocess.run([*build, str(REPO_ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("hf_scale-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True, timeout=120)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site_packages = environment / "lib" / version / "site-packages"
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = environment / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)]
    subprocess.run(install, check=True, timeout=300, capture_output=True)


def run_installed(command: list[str], folder: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`command` from the fresh environment, in `folder`, with nothing of this clone on the path."""
    env = launch_env(LOCAL_SIZE="2")
    del env["PYTHONPATH"]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_wheel_holds_the_recipes_and_the_configs(installed, tmp_path):
    shown = run_installed(
        [str(installed / "python"), "-c", "import hf_scale.recipes, hf_scale; print(hf_scale.__file__)"], tmp_path
    )
    assert shown.returncode == 0, shown.stderr
    assert str(installed.parent) in shown.stdout  # the wheel's copy, not this clone's
    listed = run_installed([str(installed / "hf-scale"), "recipes", "list"], tmp_path)
    assert listed.returncode == 0 and "llama2_7b_4xa100_zero1" in listed.stdout, listed.stderr
    # A config by name, from an empty folder: --help parses it (and exits 0); a wrong name is one clear message.
    helped = run_installed(
        [str(installed / "hf-scale"), "train", "--config", "llama2_7b_4xa100_zero1", "--help"], tmp_path
    )
    assert helped.returncode == 0 and "--zero_preset" in helped.stdout, helped.stderr
    wrong = run_installed([str(installed / "hf-scale"), "train", "--config", "llama2_7b_zero9"], tmp_path)
    assert wrong.returncode == 2
    assert "config file not found: llama2_7b_zero9 (nor a shipped config: llama2_13b_1x4090_qlora, " in wrong.stderr


def test_hf_scale_train_and_search_from_an_empty_folder(installed, tmp_path, tiny_model_dir):
    steps = ["--max_steps", "4", "--eval_steps", "2", "--save_steps", "4", "--exact_match_samples", "4"]
    trained = run_installed([str(installed / "hf-scale"), "train", *steps, "--output_dir", "trained"], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    metrics = json.loads((tmp_path / "trained" / "metrics.json").read_text())
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"]
    assert (tmp_path / "trained" / "model.safetensors").is_file()

    flags = ["--n_trials", "2", "--max_steps", "2", "--eval_steps", "2", "--output_dir", "searched"]
    searched = run_installed([str(installed / "hf-scale"), "search", *flags], tmp_path)
    assert searched.returncode == 0, searched.stderr[-3000:]
    best = json.loads((tmp_path / "searched" / "best_run.json").read_text())
    assert best["objective"] > 0 and best["hyperparameters"]


def test_accelerate_launch_of_the_installed_cli_trains_on_two_processes(installed, tmp_path, tiny_model_dir):
    launch = [str(installed / "python"), "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--main_process_port", str(free_port()), "-m", "hf_scale.cli", "train"]
    flags = ["--max_steps", "2", "--eval_steps", "2", "--exact_match_samples", "2", "--output_dir", "trained"]
    trained = run_installed([*launch, *flags], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((tmp_path / "trained" / "metrics.json").read_text())["world_size"] == 2
