import json

import pytest

from hf_scale.cli import main


def test_plan_prints_the_table_and_the_recommendation(capsys):
    assert (
        main(["plan", "--model", "meta-llama/Llama-2-7b-hf", "--gpu", "a100-80g", "--gpus", "4", "--micro-batch", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "6.74B parameters on 1 node(s) x 4 a100-80g (80.0 GiB)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("ddp", "zero", "lora"))}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "lora"}
    assert rows["ddp"][8] == "no" and rows["zero2"][8] == "yes"
    assert "recommendation: zero1 (zero_preset: zero1)" in out


def test_plan_json_is_machine_readable(capsys):
    args = ["plan", "--model", "meta-llama/Llama-2-70b-hf", "--gpu", "rtx4090-24g", "--gpus", "1", "--seq-len", "4096"]
    assert main([*args, "--micro-batch", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["parameters"] == 68_976_648_192
    assert result["recommendation"] is None and result["advice"]
    assert not any(s["fits"] for name, s in result["strategies"].items() if name != "lora")


def test_bad_input_is_one_clear_line(capsys):
    assert main(["plan", "--model", "meta-llama/Llama-2-7b-hf", "--gpu", "v100"]) == 2
    assert "hf-scale: error: gpu: unknown GPU 'v100'; known GPUs: a100-40g" in capsys.readouterr().err
    assert main(["plan", "--model", "./no/such/model", "--gpu", "a100-80g"]) == 2
    assert "cannot read a config for './no/such/model'" in capsys.readouterr().err
    assert main(["presets", "show", "zero9"]) == 2
    assert "unknown preset 'zero9'; known presets: autotp, zero0, zero1, zero2" in capsys.readouterr().err


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


@pytest.mark.parametrize("command", ["plan", "presets", "train", "env", "search", "report"])
def test_every_command_has_help_with_an_example_or_its_flags(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    if command == "plan":
        assert "examples:" in out and "hf-scale plan --model" in out
    if command == "train":  # the recipe's own help: how to launch it, then every flag
        assert "accelerate launch recipes/finetune_llama2.py" in out and "--learning_rate" in out


def test_env_reports_versions_and_devices(capsys):
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["torch"].startswith("2.") and report["devices"]["cpu_cores"] >= 1
    assert report["missing"] == []
