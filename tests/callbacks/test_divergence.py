"""The divergence guard: an injected NaN loss stops the run with the step, the learning rate and a checkpoint,
or, with divergence_action="skip", is counted and left out while training goes on. Each optimizer step is judged
once, by the per-token loss of all its micro-batches (the loss the Trainer logs), whatever their lengths."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainerCallback

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.callbacks import DivergenceGuard, TrainingDiverged
from hf_scale.checkpoints import last_complete_checkpoint
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


def run(tmp_path, tiny_model_dir, callbacks=(), **arguments) -> ScaleTrainer:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    settings = dict(
        output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=8, learning_rate=3e-3,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
    )  # fmt: skip
    trainer = ScaleTrainer(
        model=model,
        args=ScaleTrainingArguments(**{**settings, **arguments}),
        train_dataset=tiny_dataset(tokenizer).select(range(80)),
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        callbacks=[PoisonStep(model, BAD_STEP), *callbacks],
    )
    trainer.train()
    return trainer


def test_nan_stops_the_run_naming_the_step_and_learning_rate_with_a_checkpoint(tmp_path, tiny_model_dir):
    with pytest.raises(TrainingDiverged, match=rf"training diverged at step {BAD_STEP}: the loss is nan, learning"):
        run(tmp_path, tiny_model_dir, lr_scheduler_type="constant", warmup_steps=0, save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / f"diverged-step-{BAD_STEP}" / f"checkpoint-{BAD_STEP - 1}"
    saved = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert all(torch.isfinite(p).all() for p in saved.parameters())  # the weights before the bad step
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "trainer_state.json").is_file()
    # --resume takes the last periodic checkpoint, never the diagnosis one
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


def test_message_names_the_learning_rate(tmp_path, tiny_model_dir):
    with pytest.raises(TrainingDiverged, match=r"learning rate 0\.003; the weights before this step"):
        run(tmp_path, tiny_model_dir, lr_scheduler_type="constant", warmup_steps=0)


class WeightsAtEachStep(TrainerCallback):
    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_skip_leaves_the_weights_of_the_bad_step_unchanged_counts_it_and_trains_on(
    tmp_path, tiny_model_dir, accumulation
):
    weights = WeightsAtEachStep()
    trainer = run(
        tmp_path, tiny_model_dir, divergence_action="skip", gradient_accumulation_steps=accumulation,
        per_device_train_batch_size=8 // accumulation, callbacks=[weights],
    )  # fmt: skip
    assert trainer.state.global_step == 10
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    before, skipped_step, after = (weights.weights[step] for step in (BAD_STEP - 1, BAD_STEP, BAD_STEP + 1))
    assert all(torch.equal(before[name], skipped_step[name]) for name in before)  # no update, not even momentum
    assert not all(torch.equal(skipped_step[name], after[name]) for name in before)  # the next step trains
    skipped = [log.get("skipped_steps") for log in trainer.state.log_history if "loss" in log]
    assert skipped[: BAD_STEP - 1] == [None] * (BAD_STEP - 1) and skipped[BAD_STEP - 1 :] == [1] * (11 - BAD_STEP)


def test_each_step_is_judged_once_by_its_per_token_loss_whatever_its_micro_batches_hold(tmp_path, tiny_model_dir):
    """Accumulation 4: three micro-batches of one trained token, then one of a hundred. transformers divides each
    micro-batch's loss by the whole step's token count, so the micro-batches' losses look like 0.06, 0.06, 0.06, 6:
    judged one by one, that is a "spike" every step. The step's own loss is the same size at every step."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    short = {"input_ids": [1, 40, 41, 42], "attention_mask": [1] * 4, "labels": [-100, -100, -100, 42]}
    long_ids = [1, *range(40, 140)]
    long = {"input_ids": long_ids, "attention_mask": [1] * 101, "labels": [-100, *long_ids[1:]]}
    dataset = Dataset.from_list([short, short, short, long] * 16)
    args = ScaleTrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=1, gradient_accumulation_steps=4,
        learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        train_sampling_strategy="sequential", divergence_spike_factor=3.0,
    )  # fmt: skip
    trainer = ScaleTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
    )
    trainer.train()  # the micro-batch guard stopped here: "the loss 5.8 is over 3x its running mean 1.5"
    assert trainer.state.global_step == 12
    assert trainer.divergence_guard.seen == 12  # one decision (one read of the loss) per optimizer step
    last_logged = [log["loss"] for log in trainer.state.log_history if "loss" in log][-1]
    assert trainer.divergence_guard.last_loss == pytest.approx(last_logged, abs=1e-3)  # the loss the user sees


def test_off_trains_on_as_the_stock_trainer_does(tmp_path, tiny_model_dir):
    trainer = run(tmp_path, tiny_model_dir, divergence_action="off")
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())  # what the guard prevents


def test_spike_over_the_running_mean():
    guard = DivergenceGuard(spike_factor=3.0)
    assert all(guard.problem(2.0) is None for _ in range(10))
    assert guard.problem(5.9) is None  # under 3x the mean
    assert "over 3x its running mean" in guard.problem(100.0)
    assert DivergenceGuard().problem(100.0) is None  # no spike check unless asked
