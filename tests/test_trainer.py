import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainerCallback, TrainingArguments

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.errors import ConfigError
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


def forward_wrappers(model) -> int:
    """How many decorators wrap `model.forward` (each `functools.wraps` layer adds a `__wrapped__`)."""
    depth, forward = 0, model.forward
    while hasattr(forward, "__wrapped__"):
        depth, forward = depth + 1, forward.__wrapped__
    return depth


def test_evaluations_in_one_bf16_process_do_not_wrap_forward_again(tmp_path, tiny_model_dir):
    """Each evaluation used to wrap `forward` once more (autocast + fp32 outputs): a RecursionError after ~240."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    dataset, _ = tokenize_records(generate_tasks()[0][:64], tokenizer, ALPACA, max_length=128)
    args = ScaleTrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4, bf16=True, use_cpu=True,
        eval_strategy="steps", eval_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    depths = []

    class Depth(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            depths.append(forward_wrappers(model))

    trainer = ScaleTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(4)),
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        callbacks=[Depth()],
    )
    trainer.evaluate()  # before train(), as the recipe does: this preparation is undone
    trainer.train()
    trainer.evaluate()
    assert len(depths) == 14 and len(set(depths[1:])) == 1, depths


def small_run(output_dir, tiny_model_dir, **arguments) -> ScaleTrainer:
    """A 1-process trainer on 64 tiny records, saving every 4 steps; `arguments` override ScaleTrainingArguments."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    dataset, _ = tokenize_records(generate_tasks()[0][:64], tokenizer, ALPACA, max_length=128)
    settings = dict(
        output_dir=str(output_dir), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3, seed=3,
        save_strategy="steps", save_steps=4, logging_steps=1, report_to="none", disable_tqdm=True,
    )  # fmt: skip
    return ScaleTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=ScaleTrainingArguments(**{**settings, **arguments}),
        train_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
    )


def test_resuming_a_finished_run_trains_no_further_and_says_so(tmp_path, tiny_model_dir, capsys):
    small_run(tmp_path, tiny_model_dir).train()
    finished = load_file(tmp_path / "checkpoint-8" / "model.safetensors")
    for _ in range(2):  # a requeue script relaunching until done
        trainer = small_run(tmp_path, tiny_model_dir, resume="true")
        trainer.train()
        assert trainer.state.global_step == 8
        assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
        for name, tensor in trainer.model.state_dict().items():  # the finished weights, loaded, untouched
            assert torch.equal(tensor, finished[name if name in finished else "model.embed_tokens.weight"]), name
    said = capsys.readouterr().out
    assert "already finished: checkpoint-8 is at step 8 of max_steps 8; nothing left to train" in said


class Warnings(logging.Handler):
    """What transformers and hf_scale log at WARNING or above while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_resume_auto_starts_when_there_is_nothing_to_resume_and_resumes_otherwise(tmp_path, tiny_model_dir, capsys):
    first = small_run(tmp_path, tiny_model_dir, resume="auto", max_steps=4)
    first.train()
    assert "resume=auto: no complete checkpoint in" in capsys.readouterr().out and first.state.global_step == 4
    second = small_run(tmp_path, tiny_model_dir, resume="auto")
    warnings = Warnings()
    logging.getLogger("transformers").addHandler(warnings)
    try:
        second.train()
        small_run(tmp_path, tiny_model_dir, resume="auto").train()  # finished: nothing to train
    finally:
        logging.getLogger("transformers").removeHandler(warnings)
    assert second.state.global_step == 8
    assert f"resuming from {tmp_path / 'checkpoint-4'}" in capsys.readouterr().out
    assert warnings.messages == []  # e.g. not the tied lm_head.weight as "missing keys in the checkpoint"
    with pytest.raises(ConfigError, match="so there is nothing to resume"):  # the strict mode stays strict
        small_run(tmp_path / "empty", tiny_model_dir, resume="true")


def test_tensorboard_logs_go_to_output_dir_also_when_evaluating_before_training(tmp_path, tiny_model_dir, monkeypatch):
    """transformers' TensorBoardCallback opens its writer at the first log; an evaluation before train() (as the
    recipe does) opened it in the working directory's runs/, and the whole training curve went there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    trainer = small_run(tmp_path / "out", tiny_model_dir, report_to="tensorboard", save_strategy="no")
    trainer.evaluate(trainer.train_dataset.select(range(8)))
    trainer.train()
    assert not (tmp_path / "runs").exists()
    (run,) = (tmp_path / "out" / "runs").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    assert {"train/loss", "eval/loss"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("train/loss")) == 8


@pytest.mark.parametrize(
    "eval_strategy, load_best, evaluations",
    [("steps", False, 0), ("no", False, 1), ("steps", True, 1)],
    ids=["last-step-evaluated", "no-evaluation-in-training", "best-weights-loaded"],
)
def test_the_trained_weights_are_evaluated_once(tmp_path, tiny_model_dir, eval_strategy, load_best, evaluations):
    """evaluate_trained() gives training's own evaluation of its last step again (transformers evaluates the last
    step whatever eval_steps says), under the new prefix, instead of evaluating the same weights twice; it
    evaluates when training did not, or loaded the best weights at the end."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    train, _ = tokenize_records(generate_tasks()[0][:64], tokenizer, ALPACA, max_length=128)
    held_out, _ = tokenize_records(generate_tasks()[1][:32], tokenizer, ALPACA, max_length=128)
    args = ScaleTrainingArguments(
        output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=8, learning_rate=5e-3,
        eval_strategy=eval_strategy, eval_steps=3, save_strategy="steps", save_steps=3,
        load_best_model_at_end=load_best, report_to="none", disable_tqdm=True,
    )  # fmt: skip
    trainer = ScaleTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
    )
    before = trainer.evaluate(metric_key_prefix="eval_before")
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    evaluated = []
    trainer.evaluation_loop = lambda *a, original=trainer.evaluation_loop, **k: evaluated.append(1) or original(*a, **k)
    after = trainer.evaluate_trained(metric_key_prefix="eval_after")
    assert len(evaluated) == evaluations  # after training
    assert after["eval_after_loss"] < before["eval_before_loss"]
    assert after["eval_after_loss"] == pytest.approx(trainer.evaluate()["eval_loss"], abs=1e-6)  # what it stands for
    if evaluations == 0:
        assert [entry["step"] for entry in logged] == [3, 5] and after["eval_after_loss"] == logged[-1]["eval_loss"]
        assert after.keys() == {key.replace("eval_", "eval_after_", 1) for key in trainer.evaluate()}  # and epoch
