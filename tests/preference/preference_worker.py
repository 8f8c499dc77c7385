"""Preference-tunes the tiny model for a few steps under a launcher (or alone) and writes rank 0's losses and trained
weights to <output_dir>/losses.json and trained.safetensors. Launched by tests/preference/test_distributed.py; not a
test itself. Flags: ScalePreferenceArguments' (--per_device_train_batch_size, --gradient_accumulation_steps,
--zero_preset, --reference, ...) plus --lora_r."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import save_file
from transformers import AutoTokenizer, HfArgumentParser

from hf_scale.arguments import prepare_run
from hf_scale.data.templates import get_template
from hf_scale.modeling import ModelArguments, load_model
from hf_scale.preference import PreferenceTrainer, ScalePreferenceArguments, preference_pair, tokenize_preferences
from hf_scale.tiny import ensure_tiny_model
from hf_scale.tiny.tasks import generate_preference_tasks

PAIRS = 32


def main() -> None:
    model_args, args = HfArgumentParser((ModelArguments, ScalePreferenceArguments)).parse_args_into_dataclasses()
    args = prepare_run(args)  # the process group first: the model is built the same on every rank after it
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    model = load_model(model_args, str(ensure_tiny_model()), tokenizer)
    records = generate_preference_tasks()[0][:PAIRS]
    pairs = [preference_pair(record, f"pair {index}") for index, record in enumerate(records)]
    dataset, _ = tokenize_preferences(pairs, tokenizer, get_template("alpaca"), max_length=128)
    ref_model = None
    if args.reference == "model":  # a second, frozen copy of the starting model
        ref_model = load_model(ModelArguments(), str(ensure_tiny_model()), tokenizer)
    trainer = PreferenceTrainer(
        model=model, args=args, ref_model=ref_model, train_dataset=dataset, processing_class=tokenizer
    )
    step0 = trainer.evaluate(eval_dataset=dataset)  # the policy is its reference: ln 2, margins 0
    trainer.train()
    if trainer.is_world_process_zero():
        out = Path(args.output_dir)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        report = {"losses": losses, "reference": trainer.reference, "step0": step0, "origin": trainer.reference_origin}
        (out / "losses.json").write_text(json.dumps(report))
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathered under ZeRO-3, on every rank
    if trainer.is_world_process_zero():
        trained = {
            name: tensor.float().clone() for name, tensor in state.items() if "lora_" in name or not model_args.lora_r
        }
        save_file(trained, str(Path(args.output_dir) / "trained.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
