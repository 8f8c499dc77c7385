"""Trains the tiny model for a few steps under a launcher and writes what each rank saw to rank<N>.json.

Launched by the distributed tests (torchrun, single node or two nodes on loopback); not a test itself.
Extra flags are ScaleTrainingArguments flags, e.g. `--auto_cpu_ddp false`.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, HfArgumentParser

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.errors import HfScaleError
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import ensure_tiny_model, generate_tasks
from hf_scale.trainer import ScaleTrainer


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    evaluate_first = "--evaluate_first" in sys.argv  # the stock Trainer then trains without DDP
    argv = [arg for arg in sys.argv[1:] if arg != "--evaluate_first"]
    (args,) = HfArgumentParser(ScaleTrainingArguments).parse_args_into_dataclasses(
        [
            "--max_steps",
            "8",
            "--per_device_train_batch_size",
            "8",
            "--learning_rate",
            "3e-3",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--logging_steps",
            "4",
            "--ddp_find_unused_parameters",
            "false",
            "--disable_tqdm",
            "true",
            *argv,
        ],
        look_for_args_file=False,
    )
    with args.main_process_first():
        path = ensure_tiny_model()
    tokenizer = load_tokenizer(str(path))
    train_records, _ = generate_tasks()
    dataset, _ = tokenize_records(train_records[:256], tokenizer, ALPACA, max_length=128)
    model = AutoModelForCausalLM.from_pretrained(path)
    start_digest = weights_digest(model)
    trainer = ScaleTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(32)),
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        processing_class=tokenizer,
    )
    if evaluate_first:
        trainer.evaluate()
    trainer.train()
    report = {
        "rank": args.process_index,
        "world_size": args.world_size,
        "wrapper": type(trainer.model_wrapped).__name__,
        "start_digest": start_digest,
        "end_digest": weights_digest(trainer.model),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "deepspeed": bool(args.deepspeed),
    }
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / f"rank{args.process_index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    try:
        main()
    except HfScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
