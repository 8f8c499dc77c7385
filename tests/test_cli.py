import io
import json
import logging
import re
import shlex
from pathlib import Path

import optuna
import pytest

from hf_scale.cli import build_parser, main


def test_plan_prints_the_table_and_the_recommendation(capsys):
    assert (
        main(["plan", "--model", "meta-llama/Llama-2-7b-hf", "--gpu", "a100-80g", "--gpus", "4", "--micro-batch", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "6.74B parameters on 1 node(s) x 4 a100-80g (80.0 GiB)" in out
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("ddp", "zero", "lora", "qlora"))
    }
    assert set(rows) == {"ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "lora", "qlora"}
    assert rows["ddp"][8] == "no" and rows["zero2"][8] == "yes"
    assert "recommendation: zero1 (zero_preset: zero1)" in out


def test_plan_json_is_machine_readable(capsys):
    args = ["plan", "--model", "meta-llama/Llama-2-70b-hf", "--gpu", "rtx4090-24g", "--gpus", "1", "--seq-len", "4096"]
    assert main([*args, "--micro-batch", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["parameters"] == 68_976_648_192
    assert result["recommendation"] is None and result["advice"]
    assert not any(s["fits"] for name, s in result["strategies"].items() if name not in ("lora", "qlora"))


def test_bad_input_is_one_clear_line(capsys):
    assert main(["plan", "--model", "meta-llama/Llama-2-7b-hf", "--gpu", "v100"]) == 2
    assert "hf-scale: error: gpu: unknown GPU 'v100'; known GPUs: a100-40g" in capsys.readouterr().err
    assert main(["plan", "--model", "./no/such/model", "--gpu", "a100-80g"]) == 2
    assert "cannot read a config for './no/such/model'" in capsys.readouterr().err
    assert main(["presets", "show", "zero9"]) == 2
    assert "unknown preset 'zero9'; known presets: autotp, zero0, zero1, zero2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "hf-scale: error: the following arguments are required: command (see hf-scale --help)"),
        (["plan", "--gpu"], "hf-scale plan: error: argument --gpu: expected one argument (see hf-scale plan --help)"),
        (["presets", "shw"], "hf-scale presets: error: argument action: invalid choice: 'shw'"),
        (["plan", "--model", "x", "--gpu", "a100-80g", "--gpus", "four"], "argument --gpus: invalid int value: 'four'"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_presets_list_and_show(capsys):
    assert main(["presets", "list"]) == 0
    listed = capsys.readouterr().out
    rows = dict(line.split(maxsplit=1) for line in listed.splitlines())
    assert rows["zero1"] == "ZeRO-1" and rows["autotp"] == "ZeRO-1 + AutoTP tensor parallel 2"
    assert rows["zero3_offload"] == "ZeRO-3, optimizer and param offloaded to CPU"
    assert main(["presets", "show", "zero2_offload"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "hf-scale plan --model meta-llama/Llama-2-7b-hf --gpu a100-80g --gpus 4" in capsys.readouterr().out


HELPS = [
    [],
    ["plan"],
    ["presets"],
    ["train"],
    ["dpo"],
    ["env"],
    ["search"],
    ["recipes"],
    ["report"],
    ["chat"],
    ["export"],
]
RUN_FOLDER_COMMANDS = (["chat"], ["export"])  # their examples need a trained run: test_chat_and_export_examples_run


def help_of(command: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", HELPS, ids=lambda c: " ".join(c) or "hf-scale")
def test_every_help_shows_examples(command, capsys):
    out = help_of(command, capsys)
    assert "usage:" in out and "examples:" in out
    assert re.search(rf"^  hf-scale {' '.join(command)}", out, re.MULTILINE), out
    if command in (["train"], ["dpo"], ["search"]):  # then the recipe's own help: how to launch it, and every flag
        assert "accelerate launch --config_file recipes/accelerate/1node_4gpu.yaml" in out and "--learning_rate" in out


@pytest.mark.slow
def test_every_example_in_the_help_runs(tmp_path, capsys, hf_scale_cache):
    """Each `hf-scale ...` line of every help exits 0: train and search write into tmp_path, report reads a study."""
    examples = []
    for command in HELPS:
        if command in RUN_FOLDER_COMMANDS:
            continue
        out = help_of(command, capsys)
        examples += re.findall(r"^  (hf-scale [^#\n]*?)\s*(?:#.*)?$", out, re.MULTILINE)
    # A LLaMA-2 config needs its GPUs and weights: its launch is run on the tiny model by the test the README names.
    examples = [example for example in examples if "--config llama2_" not in example and "_llama2_" not in example]
    study_file = "outputs/search-tiny-cpu/optuna_study.db"
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna_study.db'}", study_name="hf_scale")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=3)
    for number, example in enumerate(dict.fromkeys(examples)):
        words = example.replace(study_file, str(tmp_path / "optuna_study.db")).split()[1:]
        words = [str(tmp_path / "report") if word.startswith("outputs/") else word for word in words]
        if words[0] in ("train", "search"):
            words += ["--output_dir", str(tmp_path / words[0])]
        if words[0] == "dpo":  # after the SFT default, which the train example has just run
            words += ["--output_dir", str(tmp_path / f"dpo-{number}")]
            words += ["--model_name_or_path", str(tmp_path / "train"), "--exact_match_samples", "0"]
        if words[:2] == ["recipes", "copy"]:
            words[-1] = str(tmp_path / words[-1])
        assert main(words) == 0, example
        capsys.readouterr()
    commands = {example.split()[1] for example in examples}
    assert commands == {"plan", "presets", "train", "dpo", "env", "search", "recipes", "report"}
    assert (tmp_path / "train" / "model.safetensors").is_file() and (tmp_path / "search" / "best_run.json").is_file()
    assert (tmp_path / "report" / "trials.csv").is_file()


@pytest.mark.slow
def test_chat_and_export_examples_run(trained_tiny_run, trained_tiny_lora_run, tmp_path, capsys, monkeypatch):
    """Each `hf-scale chat` / `hf-scale export` line of their helps, on trained tiny runs (full and LoRA): the chat
    answers the held-out question right, the exports are whole model folders (and a GGUF file)."""
    runs = {"outputs/tiny-cpu": str(trained_tiny_run), "outputs/llama2-7b-lora": str(trained_tiny_lora_run)}
    examples = [
        example
        for command in RUN_FOLDER_COMMANDS
        for example in re.findall(r"^  (hf-scale [^#\n]*?)\s*(?:#.*)?$", help_of(command, capsys), re.MULTILINE)
    ]
    assert len(examples) == 5
    for example in examples:
        words = shlex.split(example)[1:]
        words = [runs.get(word, str(tmp_path / word) if word.startswith("exported/") else word) for word in words]
        monkeypatch.setattr("sys.stdin", io.StringIO("What is 417 plus one?\n"))  # the REPL's one turn
        assert main(words) == 0, example
        out = capsys.readouterr().out
        if words[0] == "chat":
            assert "418" in out, (example, out)
    assert (tmp_path / "exported/tiny/model.safetensors").is_file()
    assert (tmp_path / "exported/llama2-7b-merged/model.safetensors").is_file()  # merged: no adapter left
    assert not (tmp_path / "exported/llama2-7b-merged/adapter_config.json").exists()
    assert (tmp_path / "exported/llama2-7b-q8_0.gguf").read_bytes()[:4] == b"GGUF"


def test_env_reports_versions_and_devices(capsys):
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["torch"].startswith("2.") and report["devices"]["cpu_cores"] >= 1
    assert report["missing"] == []


def test_recipes_copy_gives_the_recipe_to_edit(tmp_path, monkeypatch, capsys):
    import hf_scale.recipes.finetune_llama2 as recipe

    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "copy", "finetune", "my_finetune.py"]) == 0
    assert (tmp_path / "my_finetune.py").read_text() == Path(recipe.__file__).read_text()
    (tmp_path / "my_finetune.py").write_text("# edited\n")
    assert main(["recipes", "copy", "finetune", "my_finetune.py"]) == 2  # an edited copy is never overwritten
    assert "my_finetune.py exists" in capsys.readouterr().err
    assert (tmp_path / "my_finetune.py").read_text() == "# edited\n"


def test_plan_figures_of_the_four_gpu_search_estimate_are_the_readmes(capsys):
    """The README's estimate for 4 trials at once on 4x4090 quotes the qlora row's communication and compute."""
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    command = re.search(r"`hf-scale (plan --model \S+ --gpu rtx4090-24g --gpus 4 [^`]*)` plans ([\d.]+) s of", readme)
    compute = re.search(r"plans [\d.]+ s of all-reduce against ([\d.]+) s of compute per QLoRA step", readme)
    assert command and compute
    assert main(command.group(1).split()) == 0
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("qlora ")]
    assert (row[9], row[10]) == (command.group(2), compute.group(1))


def test_plan_qlora_row_says_what_fits_a_4090_as_the_readme_shows(capsys):
    """`hf-scale plan ... --lora-r 16 --quantization nf4` for 7B, 13B and 70B on one 4090: the README's QLoRA table."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = re.findall(
        r"^\| (\d+)B, micro batch (\d) \| ([\d.]+) GiB(, fits|, does not fit|) \| ([\d.]+) GiB, (fits|does not fit)",
        readme,
        re.MULTILINE,
    )
    assert [row[0] for row in rows] == ["7", "13", "70"]
    for size, micro_batch, lora_total, lora_fits, qlora_total, qlora_fits in rows:
        command = f"plan --model meta-llama/Llama-2-{size}b-hf --gpu rtx4090-24g --gpus 1 --seq-len 512 --grad-ckpt"
        assert main([*command.split(), "--micro-batch", micro_batch, "--lora-r", "16", "--quantization", "nf4"]) == 0
        printed = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if "lora" in line[:6]}
        assert printed["qlora"][6] == qlora_total and printed["qlora"][8] == ("yes" if qlora_fits == "fits" else "no")
        assert printed["lora"][6] == lora_total and (
            not lora_fits or printed["lora"][8] == ("yes" if lora_fits == ", fits" else "no")
        )


def test_bitsandbytes_optional_kernel_notice_is_not_printed(caplog):
    """Every command printed bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" (an optional
    kernel from the hub; it runs without it), `--help` included."""
    import hf_scale  # noqa: F401 -- the filter is set when hf_scale is imported

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no kernels")
        logger.warning("another bitsandbytes warning")
    assert [record.getMessage() for record in caplog.records] == ["another bitsandbytes warning"]


@pytest.mark.parametrize(
    ("argv", "name", "value"),
    [
        (["chat", "run", "--max_new_tokens", "5"], "max_new_tokens", 5),
        (["chat", "run", "--max-new-tokens", "5"], "max_new_tokens", 5),
        (["export", "run", "out", "--merge_lora"], "merge_lora", True),
        (["plan", "--model", "m", "--gpu", "a100-80g", "--seq_len", "128"], "seq_len", 128),
        (["report", "study.db", "--study_name", "s"], "study_name", "s"),
    ],
)
def test_every_command_takes_both_spellings_of_a_flag(argv, name, value):
    """`hf-scale train --max_new_tokens` and `--max-new-tokens` worked; `hf-scale chat --max_new_tokens` did not."""
    assert getattr(build_parser().parse_args(argv), name) == value
