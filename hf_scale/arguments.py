"""`ScaleTrainingArguments`: `TrainingArguments` plus the settings hf_scale adds, each documented where declared.

No `from __future__ import annotations` here: `HfArgumentParser` reads the field types at run time.
"""

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field

import torch
from transformers import SchedulerType, TrainingArguments
from transformers.integrations import get_available_reporting_integrations

from hf_scale.checkpoints import last_complete_checkpoint
from hf_scale.distributed import check_elastic_restarts, launched_world_size
from hf_scale.errors import ConfigError
from hf_scale.output_dir import check_output_dir
from hf_scale.presets import load_deepspeed_config, zero_preset

RESUME_MODES = ("false", "true", "auto")
# The TrainingArguments fields that hold a nested config (a mapping, JSON text or a file path) that transformers
# and accelerate read without checking its shape.
NESTED_CONFIGS = ("deepspeed", "fsdp_config", "accelerator_config")


@dataclass
class ScaleTrainingArguments(TrainingArguments):
    """`TrainingArguments` for instruction fine-tuning at scale; every HF argument works as usual.

    Changed defaults (cosine schedule, 3 % warm-up) follow the tuning guide; the added fields are documented where
    they are declared. They describe and validate: checks that would fail later (batch arithmetic, the DeepSpeed
    config against these arguments, a missing reporting integration) fail here; what reads the hub, writes or starts
    processes is `prepare_run`'s, called by `ScaleTrainer` (or by a script before it loads the model).

    Example:
        args = ScaleTrainingArguments(output_dir="out", zero_preset="auto", plan_model="meta-llama/Llama-2-7b-hf",
                                      global_batch_size=64, per_device_train_batch_size=2, bf16=True)
        print(args.effective_batch_size)  # 64, whatever the number of processes
    """

    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Effective batch (per_device_train_batch_size x processes x gradient_accumulation_steps) to "
            "keep whatever the number of processes: gradient_accumulation_steps is derived from it at launch. "
            "It must be a multiple of per_device_train_batch_size x processes."
        },
    )
    zero_preset: str | None = field(
        default=None,
        metadata={
            "help": "A DeepSpeed ZeRO preset shipped with hf_scale, by name (see `hf_scale.presets`); it sets "
            "`deepspeed`. 'auto' asks the memory planner for the fastest that fits (see plan_model). Leave "
            "empty to set `deepspeed` yourself or to train without DeepSpeed."
        },
    )
    resume: str = field(
        default="false",
        metadata={
            "help": "Go on from the newest complete checkpoint in output_dir: 'true' (or the bare flag) needs one "
            "and stops before any work when there is none; 'auto' resumes when there is one and starts from the "
            "first step when there is none, so that a requeue script can pass it on every launch; 'false' starts "
            "from the first step. A run whose checkpoint is already at max_steps trains no further.",
            "choices": RESUME_MODES,
            "nargs": "?",
            "const": "true",
        },
    )
    plan_model: str | None = field(
        default=None,
        metadata={
            "help": "With zero_preset='auto': the model the planner sizes (hub id, local folder or a known "
            "LLaMA-2 name; only its config is read). The recipe fills it from model_name_or_path."
        },
    )
    plan_gpu: str | None = field(
        default=None,
        metadata={
            "help": "With zero_preset='auto': the GPU from the planner's catalogue (a100-80g, rtx4090-24g, ...); "
            "by default the CUDA device found."
        },
    )
    plan_seq_len: int = field(
        default=2048,
        metadata={"help": "With zero_preset='auto': the longest sequence the planner sizes activations for."},
    )
    lr_scheduler_type: str = field(
        default="cosine",
        metadata={
            "help": "Learning rate schedule after warmup (HF SchedulerType). hf_scale's default is cosine; "
            "set min_learning_rate for a cosine that ends at a floor (other schedules have none)."
        },
    )
    warmup_steps: float = field(
        default=0.03,
        metadata={
            "help": "Linear warmup from 0 to learning_rate: an integer is steps, a float in [0, 1) a ratio of all "
            "steps (transformers 5). hf_scale's default is 3 percent of the steps."
        },
    )
    min_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Floor of the cosine schedule (sets lr_scheduler_type=cosine_with_min_lr); an error with any "
            "other schedule. In a search, the default space then keeps the schedule at cosine."
        },
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={
            "help": "Stop after this many evaluations without improvement of metric_for_best_model (eval_loss "
            "by default; its direction from greater_is_better), and end the run with the best checkpoint's "
            "weights: it turns load_best_model_at_end on, whatever it was set to."
        },
    )
    early_stopping_threshold: float = field(
        default=0.0,
        metadata={"help": "The least change of the metric that counts as an improvement for early stopping."},
    )
    log_throughput: bool = field(
        default=True,
        metadata={
            "help": "Log real (non-pad) tokens/s, samples/s, TFLOP/s per device, MFU (on a known GPU) and peak "
            "memory at each logging step, through the normal log (so report_to gets them)."
        },
    )
    divergence_action: str = field(
        default="stop",
        metadata={
            "help": "On a NaN/Inf loss of an optimizer step (its per-token loss over all its micro-batches, as "
            "logged; or a spike, see divergence_spike_factor): 'stop' saves the state before that step under "
            "output_dir/diverged-step-N and stops with a message naming the step and learning rate; 'skip' leaves "
            "the weights as they were before that step (not with DeepSpeed, whose engine steps inside the backward), "
            "counts it and trains on; 'off' trains on as the stock Trainer does."
        },
    )
    divergence_spike_factor: float | None = field(
        default=None,
        metadata={"help": "Also treat a step's loss above this factor x its running mean as divergence (e.g. 5)."},
    )
    packed_sdpa: bool = field(
        default=True,
        metadata={
            "help": "On packed batches, run a model on sdpa attention one example at a time "
            "(hf_scale_packed_sdpa) instead of over the whole row through a block-diagonal mask: the same "
            "result, at the cost of the examples' own lengths rather than the row's square. Models on eager, "
            "flash-attn or flex attention keep theirs."
        },
    )
    auto_cpu_ddp: bool = field(
        default=True,
        metadata={
            "help": "On a machine without an accelerator, set use_cpu=True when several processes are launched, "
            "so that they train as real gloo DDP instead of as independent copies, and for bf16 on one process "
            "(transformers refuses bf16 there unless use_cpu is set)."
        },
    )

    def __post_init__(self):
        # Only what describes and validates the run: nothing here reads the hub, writes a file or starts a process
        # group of its own (`prepare_run` does that). TrainingArguments' own __post_init__ still sets up its device.
        check_elastic_restarts()  # before the process group starts: that is where a bad restart would hang
        world_size = launched_world_size()
        if not torch.accelerator.is_available():
            self.dataloader_pin_memory = False  # nothing to pin for; torch warns on every loader otherwise
            if self.auto_cpu_ddp and (world_size > 1 or self.bf16):
                self.use_cpu = True
        if self.zero_preset:
            preset = None if self.zero_preset in ("auto", "ddp") else zero_preset(self.zero_preset)
            # The preset's own config is what built arguments hold: rebuilding them (dataclasses.replace) is no clash.
            if self.deepspeed and (self.zero_preset == "auto" or load_deepspeed_config(self.deepspeed) != preset):
                raise ConfigError("zero_preset and deepspeed are both set: give one DeepSpeed config, not two")
            self.deepspeed = preset
        if self.deepspeed:
            self.deepspeed = load_deepspeed_config(self.deepspeed)
            check_tensor_parallel_section(self.deepspeed)
            if world_size % self.tensor_parallel_size:
                raise ConfigError(
                    f"deepspeed: tensor_parallel.autotp_size={self.tensor_parallel_size} needs a multiple of "
                    f"{self.tensor_parallel_size} processes, got {world_size}"
                )
        if self.global_batch_size is not None:
            self.gradient_accumulation_steps = accumulation_for_global_batch(
                self.global_batch_size, self.per_device_train_batch_size, world_size // self.tensor_parallel_size
            )
        if isinstance(self.resume, bool):  # resume=True from Python is the strict mode
            self.resume = str(self.resume).lower()
        if self.resume not in RESUME_MODES:
            raise ConfigError(f"resume: {self.resume!r} is not one of {', '.join(RESUME_MODES)}")
        self._set_schedule_and_early_stopping()
        nested = [name for name in NESTED_CONFIGS if getattr(self, name)]  # before transformers replaces them
        try:
            super().__post_init__()
        except (AttributeError, TypeError, OSError) as error:
            # transformers and accelerate read these nested configs without checking their shape: a section that
            # is not a mapping, an unknown key or a path to no file fails deep inside them, as one of these types.
            # Without a nested config the same types are a bug, and keep their traceback.
            if not nested:
                raise
            raise ConfigError(
                f"{' or '.join(nested)}: cannot be read: {type(error).__name__}: {error} (check that each section is "
                "a mapping, each key a known one and each path a file)"
            ) from error
        if self.deepspeed and self.hf_deepspeed_config.mismatches:
            # transformers records them while it fills the "auto" values, but raises only once the model is loaded
            raise ConfigError(
                'the DeepSpeed config contradicts the training arguments (set those DeepSpeed values to "auto" '
                "so that the training arguments decide): "
                + "; ".join(mismatch.removeprefix("- ds ") for mismatch in self.hf_deepspeed_config.mismatches)
            )
        check_reporting_integrations(self.report_to)

    @property
    def tensor_parallel_size(self) -> int:
        """Processes that split each layer (DeepSpeed AutoTP); they all see the same batch."""
        config = self.deepspeed if isinstance(self.deepspeed, dict) else {}
        return int(config.get("tensor_parallel", {}).get("autotp_size", 1))

    @property
    def data_parallel_size(self) -> int:
        """Processes that each see their own batch: all of them, less tensor parallelism."""
        return self.world_size // self.tensor_parallel_size

    @property
    def effective_batch_size(self) -> int:
        """Examples per optimizer step across all processes."""
        return self.per_device_train_batch_size * self.data_parallel_size * self.gradient_accumulation_steps

    def _set_schedule_and_early_stopping(self) -> None:
        if self.divergence_action not in ("stop", "skip", "off"):
            raise ConfigError(f"divergence_action: {self.divergence_action!r} is not one of stop, skip, off")
        if self.divergence_action == "skip" and self.deepspeed:
            raise ConfigError(
                "divergence_action: 'skip' does not work with DeepSpeed (its engine steps inside the backward, "
                "before a step can be dropped); use 'stop' (DeepSpeed itself skips a step whose gradients are NaN/Inf)"
            )
        if self.min_learning_rate is not None:
            if not 0 <= self.min_learning_rate < self.learning_rate:
                raise ConfigError(
                    f"min_learning_rate={self.min_learning_rate} must be at least 0 and below "
                    f"learning_rate={self.learning_rate}"
                )
            schedule = SchedulerType(self.lr_scheduler_type).value
            if schedule not in ("cosine", "cosine_with_min_lr"):
                raise ConfigError(
                    f"min_learning_rate is the floor of the cosine schedule; lr_scheduler_type={schedule!r} has none: "
                    "set lr_scheduler_type to cosine, or leave min_learning_rate out"
                )
            kwargs = self.lr_scheduler_kwargs or {}
            kwargs = json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs)  # a flag gives JSON text
            if "min_lr" in kwargs:
                raise ConfigError("min_learning_rate and lr_scheduler_kwargs.min_lr are both set: give the floor once")
            self.lr_scheduler_type = "cosine_with_min_lr"
            # As a ratio of learning_rate: the floor given as min_lr is divided by `optimizer.defaults`, which
            # DeepSpeed's ZeRO optimizers do not have (every ZeRO run with a floor failed at its start).
            self.lr_scheduler_kwargs = {**kwargs, "min_lr_rate": self.min_learning_rate / self.learning_rate}
        if self.early_stopping_patience is not None:
            if self.early_stopping_patience < 1:
                raise ConfigError(f"early_stopping_patience={self.early_stopping_patience} must be at least 1")
            if str(self.eval_strategy) in ("no", "IntervalStrategy.NO"):
                raise ConfigError("early_stopping_patience needs evaluations: set eval_strategy to steps or epoch")
            self.load_best_model_at_end = True  # the run ends with the best weights, and saves those


def accumulation_for_global_batch(global_batch_size: int, per_device_batch_size: int, world_size: int) -> int:
    """Gradient accumulation steps that make `per_device x world_size x steps == global_batch_size` exactly."""
    per_step = per_device_batch_size * world_size
    if global_batch_size <= 0 or global_batch_size % per_step:
        raise ConfigError(
            f"global_batch_size={global_batch_size} cannot be reached with per_device_train_batch_size="
            f"{per_device_batch_size} on {world_size} process(es): it must be a positive multiple of "
            f"{per_device_batch_size} x {world_size} = {per_step}"
        )
    return global_batch_size // per_step


def check_tensor_parallel_section(config: dict) -> None:
    """DeepSpeed's `tensor_parallel` section, if any, must be a mapping whose `autotp_size` is a positive integer:
    `tensor_parallel_size` reads it before DeepSpeed does."""
    section = config.get("tensor_parallel", {})
    if not isinstance(section, dict):
        raise ConfigError(f'deepspeed: tensor_parallel must be a mapping such as {{"autotp_size": 2}}, got {section!r}')
    size = section.get("autotp_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"deepspeed: tensor_parallel.autotp_size must be a positive integer, got {size!r}")


def check_reporting_integrations(report_to: list[str]) -> None:
    """Every `report_to` integration must be installed: the Trainer says so only once the model is loaded."""
    if any(not isinstance(name, str) for name in report_to):  # `report_to: null` in YAML arrives as [None]
        raise ConfigError(f"report_to: names integrations (or none, or all), got {report_to!r}")
    missing = [name for name in report_to if name not in ("none", "all", *get_available_reporting_integrations())]
    if missing:
        packages = " ".join(name.replace("_", "-") for name in missing)
        raise ConfigError(
            f"report_to: {', '.join(map(repr, missing))} is not installed (pip install {packages}); "
            "or report to another integration, or to none"
        )


def prepare_run(args: ScaleTrainingArguments, model_args: typing.Any = None) -> ScaleTrainingArguments:
    """The arguments a run trains with, once what touches the network, disks and processes has been done and checked.

    `zero_preset="auto"` gets the planner's preset (it reads plan_model's config, maybe from the hub; with the
    recipe's `model_args`, LoRA or QLoRA adapters are planned as such: plain DDP when they fit); output_dir must
    be writable, and hold a complete checkpoint with resume='true'; on CPU, DeepSpeed's communication joins the gloo
    process group (ZeRO-3 asks it for the world size while `from_pretrained` partitions the weights; uninitialised
    it answers 1 and DeepSpeed's batch check fails). `ScaleTrainer` calls it; a script that loads a model under
    ZeRO-3 calls it first, as the recipes do. Calling it again changes nothing.

    Example:
        args = prepare_run(ScaleTrainingArguments(output_dir="out", zero_preset="auto", plan_model=model_path))
        model = AutoModelForCausalLM.from_pretrained(model_path)  # partitioned at load when the plan is ZeRO-3
    """
    if args.zero_preset == "auto":
        from hf_scale.presets.auto import planned_preset

        lora_r, quantization = (model_args.lora_r, model_args.quantization) if model_args else (0, None)
        args = dataclasses.replace(args, zero_preset=planned_preset(args, launched_world_size(), lora_r, quantization))
    if args.resume == "true" and not (args.output_dir and os.path.isdir(args.output_dir)):
        raise ConfigError(f"resume: output_dir {args.output_dir!r} does not exist, so there is nothing to resume")
    if args.resume == "true" and last_complete_checkpoint(args.output_dir) is None:
        raise ConfigError(f"resume: no complete checkpoint-* folder in output_dir {args.output_dir!r}")
    check_output_dir(args.output_dir)  # a run that could never save stops before any work
    if args.deepspeed and args.use_cpu and args.world_size > 1:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # joins the group the arguments' device started
    return args
