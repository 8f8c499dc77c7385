"""`PreferenceTrainer`: preference tuning (DPO and its variants) as a `ScaleTrainer`, so that ZeRO presets, LoRA and
QLoRA, the divergence guard, throughput logging, early stopping and the search stay what they are for SFT."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader
from transformers.integrations import is_deepspeed_zero3_enabled

from hf_scale.errors import ConfigError
from hf_scale.preference.arguments import REFERENCE_FREE_LOSSES, ScalePreferenceArguments
from hf_scale.preference.collator import PreferenceCollator
from hf_scale.preference.losses import preference_losses, sequence_logps
from hf_scale.trainer import ScaleTrainer

# The metrics logged, under TRL's names: means over the pairs since the last log (eval: over the evaluation).
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def reference_mode(requested: str, loss_type: str, peft: bool, ref_model: nn.Module | None) -> str:
    """The reference the run uses (`ScalePreferenceArguments.reference`), checked against the model given."""
    if requested == "auto":
        if loss_type in REFERENCE_FREE_LOSSES:
            return "none"
        return "model" if ref_model is not None else "adapters_off" if peft else "precomputed"
    if requested == "model" and ref_model is None:
        raise ConfigError("reference: model needs a reference model: PreferenceTrainer(ref_model=...)")
    if requested != "model" and ref_model is not None:
        raise ConfigError(f"reference: {requested}, but a ref_model was given: set reference model (or auto)")
    if requested == "adapters_off" and not peft:
        raise ConfigError("reference: adapters_off needs a model with LoRA adapters (lora_r > 0)")
    return requested


class PreferenceTrainer(ScaleTrainer):
    """A `ScaleTrainer` whose loss is a preference loss on (chosen, rejected) pairs.

    The dataset's rows are pairs (`tokenize_preferences`); batches hold the chosen rows, then the rejected ones
    (`PreferenceCollator`, the default collator here). The reference log-probs come from `args.reference`: a
    frozen `ref_model`, the policy with its adapters off, columns computed once before training (`precomputed`),
    or none. `args.beta` and `args.loss_type` are read at every step, so a search's trial values apply.

    Example:
        args = ScalePreferenceArguments(output_dir="out", beta=0.1, per_device_train_batch_size=4)
        pairs, summary = tokenize_preferences(load_preference_pairs("pairs.jsonl"), tokenizer, template, 1024)
        trainer = PreferenceTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
        trainer.train()
    """

    args: ScalePreferenceArguments
    # The loss is a mean over this micro-batch's pairs: the Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: Any = None,
        args: ScalePreferenceArguments | None = None,
        ref_model: nn.Module | None = None,
        data_collator: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        if args is not None and not isinstance(args, ScalePreferenceArguments):
            raise TypeError(f"PreferenceTrainer needs ScalePreferenceArguments, got {type(args).__name__}")
        if data_collator is None:
            pad = getattr(processing_class, "pad_token_id", None)
            pad = pad if pad is not None else getattr(processing_class, "eos_token_id", 0)
            data_collator = PreferenceCollator(pad_token_id=pad)
        args = args or ScalePreferenceArguments(output_dir="preference-run")
        if args.deepspeed and is_deepspeed_zero3_enabled():
            # The reference forward (and the precomputed pass, here before any step) would run on partitioned
            # weights; gathering them as TRL's inference engine does is not built yet.
            raise ConfigError(
                "PreferenceTrainer does not run under ZeRO-3 yet: use zero_preset zero2 (or zero2_offload)"
            )
        super().__init__(
            model=model, args=args, data_collator=data_collator, processing_class=processing_class, **kwargs
        )
        self.reference = reference_mode(args.reference, args.loss_type, is_peft_model(self.model), ref_model)
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = ref_model.to(self.args.device).eval().requires_grad_(False)
        # Sums on the device since the last log, per mode: read (one transfer) when logged.
        self._metric_sums: dict[str, dict[str, torch.Tensor]] = {"train": {}, "eval": {}}
        self._metric_pairs: dict[str, int] = {"train": 0, "eval": 0}
        if self.reference == "precomputed":
            self.train_dataset = self.with_reference_logps(self.train_dataset)
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {name: self.with_reference_logps(data) for name, data in self.eval_dataset.items()}
            else:
                self.eval_dataset = self.with_reference_logps(self.eval_dataset)

    def with_reference_logps(self, dataset: Dataset | None) -> Dataset | None:
        """`dataset` with `reference_chosen_logps` and `reference_rejected_logps` columns: the policy as it starts
        (its adapters off under LoRA), computed once, before any step."""
        if dataset is None or "reference_chosen_logps" in dataset.column_names:
            return dataset
        model = self.accelerator.unwrap_model(self.model)
        loader = DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator)
        chosen, rejected = [], []
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.adapters_off(model):
                for batch in loader:
                    logps = self.sequence_logps_of(model, batch)
                    batch_chosen, batch_rejected = logps.chunk(2)
                    chosen += batch_chosen.tolist()
                    rejected += batch_rejected.tolist()
        finally:
            model.train(was_training)
        return dataset.add_column("reference_chosen_logps", chosen).add_column("reference_rejected_logps", rejected)

    def adapters_off(self, model: nn.Module):
        """A context in which a LoRA policy answers as its base (nothing to do for a full model)."""
        return model.disable_adapter() if is_peft_model(model) else nullcontext()

    def sequence_logps_of(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {name: batch[name].to(self.args.device) for name in ("input_ids", "attention_mask")}
        logits = model(**inputs, use_cache=False).logits
        return sequence_logps(logits, batch["labels"].to(self.args.device))[0]

    def compute_batch_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ):
        reference_logps = self.reference_logps(model, inputs)  # first: no graph of the policy's is alive during it
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False)
        logps, lengths = sequence_logps(outputs.logits, inputs["labels"])
        args = self.args
        losses, chosen_rewards, rejected_rewards = preference_losses(
            logps,
            lengths,
            reference_logps,
            args.loss_type,
            args.beta,
            args.label_smoothing,
            args.simpo_gamma,
            args.sft_weight,
        )
        self.add_metrics(logps.detach(), chosen_rewards, rejected_rewards)
        loss = losses.mean()
        return (loss, outputs) if return_outputs else loss

    def reference_logps(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor | None:
        if self.reference == "none":
            return None
        if self.reference == "precomputed":
            if "reference_logps" not in inputs:
                raise ConfigError("reference: precomputed, but the batch has no reference_logps (a custom collator?)")
            return inputs["reference_logps"]
        batch = {name: inputs[name] for name in ("input_ids", "attention_mask", "labels")}
        with torch.no_grad():
            if self.reference == "model":
                return self.sequence_logps_of(self.ref_model, batch)
            unwrapped = self.accelerator.unwrap_model(model)  # no DDP/DeepSpeed bookkeeping for a no-grad forward
            with unwrapped.disable_adapter():
                return self.sequence_logps_of(unwrapped, batch)

    def add_metrics(self, logps: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> None:
        mode = "train" if self.model.training else "eval"
        chosen_logps, rejected_logps = logps.float().chunk(2)
        values = {
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": chosen_logps,
            "logps/rejected": rejected_logps,
        }
        sums = self._metric_sums[mode]
        for name, value in values.items():
            sums[name] = sums.get(name, 0) + value.sum()
        self._metric_pairs[mode] += len(chosen_rewards)

    def take_metrics(self, mode: str) -> dict[str, float]:
        """The means since the last call over every process's pairs (one all-reduce), and a fresh start."""
        sums, pairs = self._metric_sums[mode], self._metric_pairs[mode]
        self._metric_sums[mode], self._metric_pairs[mode] = {}, 0
        if not sums:
            return {}
        totals = torch.stack(
            [sums[name] for name in METRICS] + [torch.tensor(float(pairs), device=sums[METRICS[0]].device)]
        )
        totals = self.accelerator.reduce(totals, "sum").tolist()
        return {name: total / totals[-1] for name, total in zip(METRICS, totals[:-1], strict=True)}

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ):
        inputs = {name: value.to(self.args.device) for name, value in inputs.items()}
        with torch.no_grad():
            loss = self.compute_batch_loss(model, inputs)
        return loss.detach(), None, None

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ):
        """The loss loop, plus the pairs' reward and log-prob means (`eval_rewards/accuracies`, ...)."""
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        metrics = self.take_metrics("eval")
        output.metrics.update({f"{metric_key_prefix}_{name}": value for name, value in metrics.items()})
        return output

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:
            logs.update(self.take_metrics("train"))
        super().log(logs, *args, **kwargs)
