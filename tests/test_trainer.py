import pytest
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainingArguments

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import generate_tasks
from hf_scale.trainer import ScaleTrainer, describe_batch


def test_plain_training_arguments_are_refused(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(TypeError, match="ScaleTrainer needs ScaleTrainingArguments"):
        ScaleTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path)))


def test_single_process_training_lowers_the_loss(tmp_path, tiny_model_dir, capsys):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    dataset, _ = tokenize_records(generate_tasks()[0][:512], tokenizer, ALPACA, max_length=128)
    args = ScaleTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=40,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        learning_rate=5e-3,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = ScaleTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0] / 2
    expected = "effective batch 32 = 16 per device x 1 data-parallel process(es) x 2 accumulation step(s)"
    assert expected in capsys.readouterr().out
    assert describe_batch(args) == f"hf_scale: {expected}"
