"""The divergence guard: an injected NaN loss stops the run with the step, the learning rate and a checkpoint,
or, with divergence_action="skip", is counted and left out while training goes on."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainerCallback

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.callbacks import DivergenceGuard, TrainingDiverged
from hf_scale.data.tokenize import IGNORE_INDEX
from hf_scale.modeling import load_tokenizer
from hf_scale.trainer import ScaleTrainer
from tests.distributed.ddp_worker import tiny_dataset

BAD_STEP = 5


class PoisonStep(TrainerCallback):
    """Makes the model's logits NaN during one training step, as a bad batch or an overflow would."""

    def __init__(self, model, step: int) -> None:
        self.poisoned = False
        model.lm_head.register_forward_hook(
            lambda module, inputs, output: output * float("nan") if self.poisoned else None
        )
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        self.poisoned = state.global_step + 1 == self.step

    def on_step_end(self, args, state, control, **kwargs):
        self.poisoned = False


def run(tmp_path, tiny_model_dir, **arguments) -> ScaleTrainer:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = ScaleTrainingArguments(
        output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=8, learning_rate=3e-3,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, **arguments,
    )  # fmt: skip
    trainer = ScaleTrainer(
        model=model,
        args=args,
        train_dataset=tiny_dataset(tokenizer).select(range(80)),
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        callbacks=[PoisonStep(model, BAD_STEP)],
    )
    trainer.train()
    return trainer


def test_nan_stops_the_run_naming_the_step_and_learning_rate_with_a_checkpoint(tmp_path, tiny_model_dir):
    with pytest.raises(TrainingDiverged, match=rf"training diverged at step {BAD_STEP}: the loss is nan, learning"):
        run(tmp_path, tiny_model_dir, lr_scheduler_type="constant", warmup_steps=0)
    checkpoint = tmp_path / f"checkpoint-{BAD_STEP}"
    saved = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert all(torch.isfinite(p).all() for p in saved.parameters())  # the weights before the bad step
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "trainer_state.json").is_file()


def test_message_names_the_learning_rate(tmp_path, tiny_model_dir):
    with pytest.raises(TrainingDiverged, match=r"learning rate 0\.003; the weights before this step"):
        run(tmp_path, tiny_model_dir, lr_scheduler_type="constant", warmup_steps=0)


def test_skip_counts_the_bad_micro_batch_and_trains_on(tmp_path, tiny_model_dir):
    trainer = run(tmp_path, tiny_model_dir, divergence_action="skip")
    assert trainer.state.global_step == 10
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    skipped = [log.get("skipped_micro_batches") for log in trainer.state.log_history if "loss" in log]
    assert skipped[: BAD_STEP - 1] == [None] * (BAD_STEP - 1) and skipped[BAD_STEP - 1 :] == [1] * (11 - BAD_STEP)


def test_off_trains_on_as_the_stock_trainer_does(tmp_path, tiny_model_dir):
    trainer = run(tmp_path, tiny_model_dir, divergence_action="off")
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())  # what the guard prevents


def test_spike_over_the_running_mean():
    guard = DivergenceGuard(spike_factor=3.0)
    assert all(guard.problem(2.0) is None for _ in range(10))
    assert guard.problem(5.9) is None  # under 3x the mean
    assert "over 3x its running mean" in guard.problem(100.0)
    assert DivergenceGuard().problem(100.0) is None  # no spike check unless asked
