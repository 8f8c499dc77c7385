"""`PreferenceTrainer`: preference tuning (DPO and its variants) as a `ScaleTrainer`, so that ZeRO presets, LoRA and
QLoRA, the divergence guard, throughput logging, early stopping and the search stay what they are for SFT."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from datasets import Dataset
from torch import nn
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer_utils import BestRun

from hf_scale.errors import ConfigError
from hf_scale.preference.arguments import REFERENCE_FREE_LOSSES, ScalePreferenceArguments
from hf_scale.preference.collator import PreferenceCollator, pad_token_id
from hf_scale.preference.losses import packed_sequence_logps, preference_losses, sequence_logps
from hf_scale.preference.reference import (
    cached_reference,
    keep_reference_logps,
    pairs_digest,
    read_reference_logps,
    reference_key,
    weights_digest,
)
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
    zero3 = is_deepspeed_zero3_enabled()
    if requested == "auto":
        if loss_type in REFERENCE_FREE_LOSSES:
            return "none"
        if ref_model is not None:
            requested = "model"
        else:
            # Under ZeRO-3 a forward outside the training engine would meet partitioned weights: the reference is
            # computed once, through the engine, before the first step.
            return "adapters_off" if peft and not zero3 else "precomputed"
    if requested == "model" and ref_model is None:
        raise ConfigError("reference: model needs a reference model: PreferenceTrainer(ref_model=...)")
    if requested != "model" and ref_model is not None:
        raise ConfigError(f"reference: {requested}, but a ref_model was given: set reference model (or auto)")
    if requested == "adapters_off" and not peft:
        raise ConfigError("reference: adapters_off needs a model with LoRA adapters (lora_r > 0)")
    if zero3 and requested in ("model", "adapters_off"):
        raise ConfigError(
            f"reference: {requested} does not run under ZeRO-3 (its forward would meet partitioned weights): use "
            "reference precomputed (or auto), computed once through the training engine"
        )
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
            data_collator = PreferenceCollator(pad_token_id(processing_class))
        args = args or ScalePreferenceArguments(output_dir="preference-run")
        super().__init__(
            model=model, args=args, data_collator=data_collator, processing_class=processing_class, **kwargs
        )
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = ref_model.to(self.args.device).eval().requires_grad_(False)
        reference_mode(args.reference, args.loss_type, is_peft_model(self.model), ref_model)  # a mistake stops here
        # Sums on the device since the last log, per mode: read (one transfer) when logged.
        self._metric_sums: dict[str, dict[str, torch.Tensor]] = {"train": {}, "eval": {}}
        self._metric_pairs: dict[str, int] = {"train": 0, "eval": 0}
        self._computing_reference = False
        # How each set got its reference log-probs: "computed" or "read" (from the cache), with the cache folder.
        self.reference_origin: dict[str, tuple[str, str]] = {}

    @property
    def reference(self) -> str:
        """Where this run's reference log-probs come from: model, adapters_off, precomputed or none."""
        return reference_mode(self.args.reference, self.args.loss_type, is_peft_model(self.model), self.ref_model)

    def train(self, *args: Any, **kwargs: Any):
        self.add_reference_logps()  # from the starting weights: a resumed run loads its checkpoint after this
        if self.throughput is not None:  # the logged FLOPs count the reference's forward at every step
            self.throughput.reference_forward = self.model is not None and self.reference in ("model", "adapters_off")
        return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        given = kwargs.get("eval_dataset", args[0] if args else None)
        if given is None:
            self.add_reference_logps()
        elif self.reference == "precomputed":
            kwargs["eval_dataset"], args = self.with_reference_logps(given, "eval_dataset"), args[1:]
        return super().evaluate(*args, **kwargs)

    def add_reference_logps(self) -> None:
        """Give the train and eval sets their precomputed reference log-probs, when the run uses them and they have
        none yet: read from the cache, or computed from the model as it is now (the run's start) and kept there."""
        if self.model is None or self.reference != "precomputed":
            return
        datasets = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"": self.eval_dataset}
        if all(
            d is None or "reference_chosen_logps" in d.column_names for d in [self.train_dataset, *datasets.values()]
        ):
            return
        weights = self.starting_weights()  # before any computation: an engine built for it may cast the weights
        self.train_dataset = self.with_reference_logps(self.train_dataset, "train", weights)
        with_logps = {
            name: self.with_reference_logps(data, f"eval {name}".strip(), weights) for name, data in datasets.items()
        }
        self.eval_dataset = with_logps if isinstance(self.eval_dataset, dict) else with_logps[""]

    def starting_weights(self) -> list[str]:
        """The digest of the weights the reference is computed from: every process's part under ZeRO-3."""
        own = weights_digest(self.accelerator.unwrap_model(self.model))
        return gather_object([own]) if is_deepspeed_zero3_enabled() else [own]

    def with_reference_logps(
        self, dataset: Dataset | None, name: str, weights: list[str] | None = None
    ) -> Dataset | None:
        """`dataset` with `reference_chosen_logps` and `reference_rejected_logps` columns: the policy as it starts
        (its adapters off under LoRA), read from the cache or computed once (every process its share, through the
        evaluation loop, so that ZeRO-3's partitioned weights are gathered as for an evaluation) and kept there."""
        if dataset is None or "reference_chosen_logps" in dataset.column_names:
            return dataset
        model = self.accelerator.unwrap_model(self.model)
        precision = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else str(next(model.parameters()).dtype)
        key = reference_key(pairs_digest(dataset), weights or self.starting_weights(), precision)
        # Every process reads, or none does: the computation is collective.
        found = gather_object([cached_reference(key) is not None])
        started = time.perf_counter()
        if all(found):
            folder = cached_reference(key)
            logps, origin = read_reference_logps(folder), "read"
        else:
            logps, origin = self.compute_reference_logps(dataset), "computed"
            folder = keep_reference_logps(key, logps) if self.is_local_process_zero() else None
        self.reference_origin[name] = (origin, str(folder or ""))
        if self.is_world_process_zero():
            where = f"from the cache {folder}" if origin == "read" else f"and kept in {folder}"
            print(
                f"hf_scale: reference log-probs of {len(dataset)} {name} pairs {origin} {where} "
                f"({time.perf_counter() - started:.1f} s)",
                flush=True,
            )
        return dataset.add_column("reference_chosen_logps", logps[:, 0].tolist()).add_column(
            "reference_rejected_logps", logps[:, 1].tolist()
        )

    def compute_reference_logps(self, dataset: Dataset) -> np.ndarray:
        """The (pairs, 2) chosen and rejected log-probs of the model as it is, its adapters off."""
        self._computing_reference = True
        try:
            output = self.predict(dataset, metric_key_prefix="reference")
        finally:
            self._computing_reference = False
        return np.asarray(output.predictions, dtype=np.float32).reshape(len(dataset), 2)

    def adapters_off(self, model: nn.Module):
        """A context in which a LoRA policy answers as its base (nothing to do for a full model)."""
        return model.disable_adapter() if is_peft_model(model) else nullcontext()

    def forward_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """(the model's outputs, each sequence's summed log-prob, its labelled tokens) for a padded or packed batch."""
        names = ("input_ids", "attention_mask", "position_ids")
        outputs = model(**{name: batch[name] for name in names if name in batch}, use_cache=False)
        if "sequence_ids" in batch:
            return outputs, *packed_sequence_logps(outputs.logits, batch["labels"], batch["sequence_ids"])
        return outputs, *sequence_logps(outputs.logits, batch["labels"])

    def sequence_logps_of(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.forward_logps(model, {name: value.to(self.args.device) for name, value in batch.items()})[1]

    def compute_batch_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ):
        reference_logps = self.reference_logps(model, inputs)  # first: no graph of the policy's is alive during it
        outputs, logps, lengths = self.forward_logps(model, inputs)
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
        peft = is_peft_model(self.accelerator.unwrap_model(model))
        reference = reference_mode(self.args.reference, self.args.loss_type, peft, self.ref_model)
        if reference == "none":
            return None
        if reference == "precomputed":
            if "reference_logps" not in inputs:
                raise ConfigError("reference: precomputed, but the batch has no reference_logps (a custom collator?)")
            return inputs["reference_logps"]
        batch = {name: value for name, value in inputs.items() if name not in ("reference_logps", "use_cache")}
        with torch.no_grad():
            if reference == "model":
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
        if self._computing_reference:  # the rows' log-probs, as (pairs, 2) "predictions" gathered in order
            with torch.no_grad(), self.adapters_off(self.accelerator.unwrap_model(model)):
                logps = self.sequence_logps_of(model, inputs)
            return None, torch.stack(logps.chunk(2), dim=1), None
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

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | None = None,
        backend: str | None = "optuna",
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun:
        """`ScaleTrainer.hyperparameter_search` over `preference_hp_space()` by default (learning rate, beta, loss).

        eval_loss cannot rank trials whose beta or loss type differ (the loss's scale changes with both): with such
        a space, set `metric_for_best_model` to exact_match (held-out greedy answers, `generation_eval`) or
        rewards/accuracies (held-out reward accuracy, which beta does not scale), or pass `compute_objective`. In
        short trials reward accuracy tends to tie: Adam's first steps move every trial's rewards the same way
        whatever its rate and beta (measured: 4 trials, rates 2e-7 to 1.5e-4, the same accuracy at every evaluation).
        The precomputed reference is made (or read) once, here, before any trial or parallel worker starts: every
        trial starts from the same weights and reads it.

        Example:
            args = ScalePreferenceArguments(output_dir="out", metric_for_best_model="exact_match",
                                            eval_strategy="steps", eval_steps=50)
            trainer = PreferenceTrainer(model_init=lambda: load_model(model_args, path, tokenizer), args=args,
                                        train_dataset=pairs, eval_dataset=held_out_pairs,
                                        generation_eval=GenerationEval(held_out_records, template))
            best = trainer.hyperparameter_search(n_trials=8, pruner="median")
        """
        from hf_scale.hpo.objective import objective_metric  # optuna is needed only here
        from hf_scale.hpo.space import loss_scale_keys, preference_hp_space

        hp_space = hp_space or preference_hp_space()
        if compute_objective is None and objective_metric(self.args) == "eval_loss":
            if varied := loss_scale_keys(hp_space):
                raise ConfigError(
                    f"metric_for_best_model: eval_loss cannot rank trials whose {', '.join(varied)} differ (the "
                    "preference loss's scale changes with them): set metric_for_best_model exact_match (held-out "
                    "greedy answers, with generation_eval) or rewards/accuracies, or pass compute_objective"
                )
        self.add_reference_logps()
        return super().hyperparameter_search(
            hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs
        )

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:
            logs.update(self.take_metrics("train"))
        super().log(logs, *args, **kwargs)
