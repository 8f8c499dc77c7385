"""Issue #8 part 4: every bad config or data input, one row each, through the real recipe.

Each row must stop with one `error:` line that names the key, file, record or field, before any model is loaded
or training starts, and leave an existing output folder exactly as it was. Every row calls the recipe's `main`
in-process (the same code, without 10 s of imports per run); one row also runs as a user runs the recipe, as a
subprocess: exit code 2, no traceback.
"""

import json
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import check_examples_left, tokenize_records
from hf_scale.errors import HfScaleError
from hf_scale.modeling import load_tokenizer
from tests.helpers import REPO_ROOT, run_command

RECIPE = REPO_ROOT / "recipes" / "finetune_llama2.py"
GOOD = [{"instruction": f"Add one to {n}.", "input": "", "output": str(n + 1)} for n in range(20)]
LATIN1_RECORD = '{"instruction": "Caf\xe9?", "input": "", "output": "yes"}\n'.encode("latin-1")


def jsonl(records) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir):
    """Every bad input of the table, made once: data files and model folders."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "good.jsonl").write_text(jsonl(GOOD))
    (root / "broken.jsonl").write_text(jsonl(GOOD[:2]) + '{"instruction": "Add one to 7.", "output": "8"\n')
    (root / "not_an_object.jsonl").write_text(jsonl(GOOD[:1]) + '["Add one to 7.", "", "8"]\n' + jsonl(GOOD[1:]))
    (root / "wrong_type.jsonl").write_text(jsonl([GOOD[0], {**GOOD[1], "input": 7}, *GOOD[2:]]))
    (root / "empty_response.jsonl").write_text(jsonl([GOOD[0], {**GOOD[1], "output": "  "}, *GOOD[2:]]))
    (root / "latin1.jsonl").write_bytes(jsonl(GOOD[:1]).encode() + LATIN1_RECORD + jsonl(GOOD[1:]).encode())
    (root / "empty.jsonl").write_text("")
    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_model_dir / "config.json", no_weights)
    pickle_only = root / "pickle-only"
    shutil.copytree(tiny_model_dir, pickle_only, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(tiny_model_dir / "model.safetensors"), pickle_only / "pytorch_model.bin")
    return root


# (id, YAML config, extra flags, what the one error line must say). {inputs} and {out} are filled in per test.
CASES = [
    # configs
    ("quantized base without LoRA", "quantization: nf4", [], r"quantization: nf4 weights are frozen .*set lora_r"),
    ("int8 base on CPU", "quantization: int8\nlora_r: 8", [], r"quantization: int8 on CPU is refused"),
    ("unknown quantization", "quantization: nf8\nlora_r: 8", [], r"quantization must be one of nf4, fp4, int8"),
    (
        "quantized base under ZeRO-3",
        "quantization: nf4\nlora_r: 8\nzero_preset: zero3",
        [],
        r"quantization: nf4 trains with data parallelism only .* not with zero_preset zero3",
    ),
    ("unknown key", "lerning_rate: 1e-4", [], r"config file .*bad.yaml: unknown key 'lerning_rate' \(did you mean"),
    ("wrong type", "max_length: long", [], r"config file .*bad.yaml: key 'max_length': invalid int value: 'long'"),
    ("list for one value", "learning_rate: [1e-4, 2e-4]", [], r"key 'learning_rate' takes one value"),
    (
        "unknown key on the command line",
        "",
        ["--learning_rat", "1e-3"],
        r"command line: unknown key 'learning_rat' \(did you mean 'learning_rate'\?\)",
    ),
    (
        "wrong type on the command line",
        "",
        ["--per_device_train_batch_size", "many"],
        r"command line: key 'per_device_train_batch_size': invalid int value: 'many'",
    ),
    (
        "impossible batch arithmetic",
        "per_device_train_batch_size: 32\nglobal_batch_size: 48",
        [],
        r"global_batch_size=48 cannot be reached with per_device_train_batch_size=32 on 1 process",
    ),
    ("unknown preset", "zero_preset: zero9", [], r"zero_preset: unknown preset 'zero9'; known presets: .*zero2"),
    ("unknown template", "template: vicuna", [], r"template: unknown template 'vicuna'; known templates: alpaca"),
    ("missing config file", None, [], r"config file not found: .*nope.yaml"),
    ("missing data file", "dataset: {inputs}/nope.jsonl", [], r"dataset: data file not found: .*nope.jsonl"),
    (
        "missing eval data file",
        "dataset: {inputs}/good.jsonl\neval_dataset: {inputs}/nope.json",
        [],
        r"eval_dataset: data file not found: .*nope.json",
    ),
    (
        "missing model folder",
        "model_name_or_path: {inputs}/no-such-model",
        [],
        r"model_name_or_path: model folder not found: .*no-such-model",
    ),
    (
        "model folder without weights",
        "model_name_or_path: {inputs}/no-weights",
        [],
        r"model_name_or_path: folder .*no-weights has no weights",
    ),
    (
        "pickle-only model folder",
        "model_name_or_path: {inputs}/pickle-only",
        [],
        r"model_name_or_path: folder .*pickle-only has only pickle weights \(pytorch_model.bin\)",
    ),
    (
        "output folder is a file",
        "",
        ["--output_dir", "{out}/marker.txt"],
        r"output_dir: .*marker.txt exists and is not a folder",
    ),
    (
        "output folder under a file",
        "",
        ["--output_dir", "{out}/marker.txt/run"],
        r"output_dir: cannot create .*marker.txt/run: .*marker.txt is a file",
    ),
    # data
    (
        "broken JSON line",
        "dataset: {inputs}/broken.jsonl",
        [],
        r"dataset: could not read .*broken.jsonl: line 3, column \d+: not valid JSON",
    ),
    (
        "record not an object",
        "dataset: {inputs}/not_an_object.jsonl",
        [],
        r"dataset: could not read .*not_an_object.jsonl: line 2: a record must be a JSON object, got list",
    ),
    (
        "wrong field type",
        "dataset: {inputs}/wrong_type.jsonl",
        [],
        r"wrong_type.jsonl: record 1: field 'input' must be text, got int",
    ),
    (
        "empty response",
        "dataset: {inputs}/empty_response.jsonl",
        [],
        r"empty_response.jsonl: record 1: field 'output' is empty",
    ),
    (
        "missing field",
        "dataset: {inputs}/good.jsonl\noutput_field: response",
        [],
        r"good.jsonl: record 0: missing field 'response'",
    ),
    (
        "non-UTF-8 bytes",
        "dataset: {inputs}/latin1.jsonl",
        [],
        r"dataset: .*latin1.jsonl is not valid UTF-8 text: line 2, column 21: byte 0xe9",
    ),
    ("empty data file", "dataset: {inputs}/empty.jsonl", [], r"dataset: .*empty.jsonl is empty: no records"),
    (
        "over-long records: none fits",
        "dataset: {inputs}/good.jsonl\nmax_length: 16\ntruncation: drop",
        [],
        r"max_length=16 leaves no train example in .*good.jsonl: all 19 records dropped \(0 because the prompt alone "
        r"fills max_length, 19 too long with truncation='drop'\)",
    ),
]
SUBPROCESS_CASE = "non-UTF-8 bytes"  # a data error: the deepest a row goes before it stops


@pytest.fixture(scope="module")
def recipe():
    from hf_scale.recipes import finetune_llama2

    return finetune_llama2


@pytest.fixture
def output_dir(tmp_path):
    """An output folder from an earlier run: nothing in it may change."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "marker.txt").write_text("from an earlier run\n")
    return out


def argv_for(case, inputs, out, tmp_path) -> list[str]:
    _, config, flags, _ = CASES[[c[0] for c in CASES].index(case)]
    config_path = tmp_path / ("nope.yaml" if config is None else "bad.yaml")
    if config is not None:
        config_path.write_text(config.format(inputs=inputs, out=out) + "\n")
    # cache_tokenized off: a row that tokenizes must not be answered from another row's cache entry
    argv = ["--config", str(config_path), "--output_dir", str(out), "--cache_tokenized", "false"]
    return argv + [flag.format(inputs=inputs, out=out) for flag in flags]


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def assert_nothing_written(output_dir, tmp_path, before):
    assert snapshot(output_dir) == before
    assert not list(tmp_path.rglob("checkpoint-*"))


@pytest.mark.parametrize("case, config, flags, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_stops_before_any_work_with_one_clear_error(
    case, config, flags, message, inputs, output_dir, tmp_path, recipe, monkeypatch, hf_scale_cache
):
    def too_late(*args, **kwargs):
        raise AssertionError(f"{case}: the mistake was not caught before the model was loaded")

    monkeypatch.setattr(recipe, "load_model", too_late)
    monkeypatch.setattr(recipe, "ScaleTrainer", too_late)
    before = snapshot(output_dir)
    with pytest.raises(HfScaleError) as caught:  # what the recipe prints as `error: ...` and exits 2 on
        recipe.main(argv_for(case, inputs, output_dir, tmp_path))
    assert caught.match(message)
    assert "\n" not in str(caught.value)  # one line
    assert_nothing_written(output_dir, tmp_path, before)


@pytest.mark.slow  # about 25 s: the imports of one recipe process on a busy 2-core machine
def test_the_recipe_exits_2_with_one_error_line_and_no_traceback(inputs, output_dir, tmp_path, hf_scale_cache):
    message = CASES[[c[0] for c in CASES].index(SUBPROCESS_CASE)][3]
    before = snapshot(output_dir)
    argv = argv_for(SUBPROCESS_CASE, inputs, output_dir, tmp_path)
    result = run_command([sys.executable, str(RECIPE), *argv], timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr[-3000:]
    assert re.search(message, errors[0]), errors[0]
    assert "Traceback" not in result.stderr
    assert_nothing_written(output_dir, tmp_path, before)


def test_over_long_records_the_policy_can_handle_are_counted_not_refused(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    long_record = {"instruction": "Repeat the number.", "input": "", "output": " ".join(["12345"] * 40)}
    records = [*GOOD[:3], long_record]
    for truncation, counted in (("drop", "1 dropped"), ("keep_prompt", "1 with the response cut")):
        _, summary = tokenize_records(records, tokenizer, ALPACA, max_length=64, truncation=truncation)
        check_examples_left("train", summary, 64, truncation)  # some left: policy, not an error
        assert summary.examples == (3 if truncation == "drop" else 4)
        assert counted in str(summary)
