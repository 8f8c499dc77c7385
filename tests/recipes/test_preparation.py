"""The recipe's data step (hf_scale/recipes/preparation.py), in this process."""

import json
import shutil

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.arguments import DataArguments
from hf_scale.modeling import ModelArguments
from hf_scale.recipes.preparation import parse_recipe_arguments, prepare_data
from hf_scale.tiny import generate_tasks
from tests.data.chat_tokenizers import CHATML_TEMPLATE, chatml_tokenizer


def test_template_chat_template_keeps_the_models_own_template_for_the_saved_tokenizer(tmp_path, tiny_model_dir):
    """A chat model trained on Alpaca records through its own template (`--template chat_template`) saves that
    template with its tokenizer: `hf-scale chat` and `apply_chat_template` prompt the run as it was trained."""
    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model_dir)
    chatml_tokenizer(tiny_model_dir).save_pretrained(model_dir)  # a ChatML template beside the weights
    records = tmp_path / "records.json"
    records.write_text(json.dumps(generate_tasks()[0][:40]))
    flags = ["--model_name_or_path", str(model_dir), "--dataset", str(records), "--template", "chat_template"]
    flags += ["--output_dir", str(tmp_path / "run"), "--exact_match_samples", "2"]
    model_args, data_args, args = parse_recipe_arguments(
        flags, (ModelArguments, DataArguments, ScaleTrainingArguments), "tiny_cpu", ""
    )
    data = prepare_data(model_args, data_args, args)
    assert data.tokenizer.chat_template == CHATML_TEMPLATE
    data.tokenizer.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == CHATML_TEMPLATE
