"""ZeRO presets really train: 2 processes on CPU, the same fp32 losses as plain DDP, step by step.

Also: AutoTP splits the attention projections across ranks; ZeRO-3 and AutoTP save a normal HF folder with the
trained weights; bf16 trains. Resuming under ZeRO-2 and ZeRO-3 is in test_resume.py. The DDP, ZeRO-2 and ZeRO-3
runs are the shared reference runs of conftest.py (the fault tests compare their weights with them).
The offload presets run DeepSpeed's CPU Adam, compiled on first use into TORCH_EXTENSIONS_DIR (about a minute).
"""

import json

import pytest
from transformers import AutoModelForCausalLM

from hf_scale.modeling import load_tokenizer
from tests.distributed.ddp_worker import eval_loss_of_folder
from tests.helpers import assert_succeeded, run_command, torchrun

WORKER = "tests/distributed/ddp_worker.py"
STEPS = ["--max_steps", "20", "--logging_steps", "1"]
HIDDEN = 64  # the tiny model's hidden size
pytestmark = pytest.mark.slow


def train(output_dir, *flags):
    result = run_command(torchrun(WORKER, "--output_dir", str(output_dir), *STEPS, *flags), timeout=400)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
    return [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def max_difference(losses, reference):
    return max(abs(a - b) for a, b in zip(losses, reference, strict=True))


@pytest.fixture(scope="module")
def ddp_losses(reference_run):
    rank0, _ = reference_run(None).reports
    assert rank0["wrapper"] == "DistributedDataParallel" and len(rank0["losses"]) == 20
    return rank0["losses"]


@pytest.mark.parametrize(
    "preset, evaluate_first",
    [
        ("zero0", False),
        ("zero1", True),
        ("zero2", False),
        ("zero2_offload", False),
        ("zero3", False),
        ("zero3_offload_optimizer", False),
        ("zero3_offload", True),
    ],
    ids=lambda value: {True: "evaluate-then-train", False: "train"}.get(value, value),
)
def test_preset_matches_ddp(tmp_path, ddp_losses, reference_run, tiny_model_dir, preset, evaluate_first):
    if preset in ("zero2", "zero3"):  # save_model under ZeRO-3 (--save_final): a normal folder, trained weights
        run = reference_run(preset)
        (rank0, rank1), tmp_path = run.reports, run.folder
    else:
        rank0, rank1 = train(tmp_path, "--zero_preset", preset, *(["--evaluate_first"] if evaluate_first else []))
    assert rank0["wrapper"] == rank1["wrapper"] == "DeepSpeedEngine" and rank0["world_size"] == 2
    assert max_difference(rank0["losses"], ddp_losses) < 1e-4
    assert rank0["losses"][-1] < rank0["losses"][0] / 2
    if not preset.startswith("zero3"):  # under ZeRO-3 each rank holds only its shard
        assert rank0["end_digest"] == rank1["end_digest"]
    if preset == "zero3":
        trained = saved_model_eval_loss(tmp_path / "final", tiny_model_dir)
        assert trained == pytest.approx(rank0["final_eval_loss"], abs=1e-5)
        assert trained < saved_model_eval_loss(tiny_model_dir, tiny_model_dir) / 2  # not the initial weights


def saved_model_eval_loss(folder, tiny_model_dir) -> float:
    return eval_loss_of_folder(folder, load_tokenizer(str(tiny_model_dir)))


def test_autotp_splits_attention_across_ranks_and_matches_ddp(tmp_path, ddp_losses, tiny_model_dir):
    # Tensor parallel over both processes leaves one data-parallel replica: it takes DDP's whole batch of 16.
    rank0, rank1 = train(tmp_path, "--zero_preset", "autotp", "--per_device_train_batch_size", "16", "--save_final")
    assert rank0["effective_batch_size"] == 16
    assert rank0["q_proj_shape"] == rank1["q_proj_shape"] == [HIDDEN // 2, HIDDEN]  # output rows split
    assert rank0["o_proj_shape"] == rank1["o_proj_shape"] == [HIDDEN, HIDDEN // 2]  # input columns split
    assert max_difference(rank0["losses"], ddp_losses) < 1e-4
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert list(saved.model.layers[0].self_attn.q_proj.weight.shape) == [HIDDEN, HIDDEN]  # gathered on save
    assert saved_model_eval_loss(tmp_path / "final", tiny_model_dir) == pytest.approx(
        rank0["final_eval_loss"], abs=1e-5
    )


def test_bf16_zero2_trains_close_to_fp32_ddp(tmp_path, ddp_losses):
    rank0, _ = train(tmp_path, "--zero_preset", "zero2", "--bf16", "true")
    assert rank0["losses"][-1] < rank0["losses"][0] / 2
    assert max_difference(rank0["losses"], ddp_losses) < 0.05  # bf16 rounding, not a different run
