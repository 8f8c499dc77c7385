"""The public API's docstrings say what each part does and show it in use: an `Example:` block that compiles."""

import importlib
import inspect
import textwrap

import pytest

PUBLIC_API = [
    "hf_scale.trainer:ScaleTrainer",
    "hf_scale.trainer:ScaleTrainer.hyperparameter_search",
    "hf_scale.arguments:ScaleTrainingArguments",
    "hf_scale.arguments:prepare_run",
    "hf_scale.data.templates:get_template",
    "hf_scale.data.loading:load_records",
    "hf_scale.data.tokenize:tokenize_records",
    "hf_scale.data.batching:make_collator",
    "hf_scale.packed_attention:use_packed_sdpa",
    "hf_scale.data.cache:cached_folder",
    "hf_scale.memory:plan",
    "hf_scale.presets:zero_preset",
    "hf_scale.evaluation:GenerationEval",
    "hf_scale.modeling:load_tokenizer",
    "hf_scale.modeling:load_model",
    "hf_scale.checkpoints:last_complete_checkpoint",
    "hf_scale.preference.trainer:PreferenceTrainer",
    "hf_scale.preference.arguments:ScalePreferenceArguments",
    "hf_scale.preference.data:tokenize_preferences",
]


def resolve(spec: str):
    module, _, attribute = spec.partition(":")
    found = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


@pytest.mark.parametrize("spec", PUBLIC_API)
def test_public_api_has_a_docstring_with_an_example_that_compiles(spec):
    doc = inspect.getdoc(resolve(spec))
    assert doc and "\nExample:\n" in doc, f"{spec}: no Example: block"
    example = textwrap.dedent(doc.split("\nExample:\n", 1)[1].split("\n\n", 1)[0])
    compile(example, spec, "exec")
