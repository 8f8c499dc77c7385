import pytest
from datasets import Dataset

from hf_scale.data.cache import COMPLETE, cached_folder, dataset_files, digest, read_dataset, tokenizer_digest
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import examples_of, tokenize_records
from hf_scale.tiny import generate_tasks


def test_a_folder_is_built_once_and_appears_whole(tmp_path):
    built = []

    def build(folder):
        built.append(folder)
        (folder / "part").write_text("x")
        (folder / COMPLETE).write_text("{}")

    folder, reused = cached_folder(tmp_path, "key", build)
    assert not reused and (folder / "part").read_text() == "x" and len(built) == 1
    assert cached_folder(tmp_path, "key", build) == (folder, True) and len(built) == 1

    def broken(folder):
        (folder / "part").write_text("half")
        raise RuntimeError("killed mid-way")

    with pytest.raises(RuntimeError):
        cached_folder(tmp_path, "other", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]  # no half entry, no staging left


def test_tokenized_examples_are_read_back_memory_mapped_and_equal(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = generate_tasks()[0][:300]
    in_memory, _ = tokenize_records(records, tokenizer, ALPACA, max_length=48, truncation="drop")
    written, summary = tokenize_records(
        records, tokenizer, ALPACA, max_length=48, truncation="drop", cache_file_name=str(tmp_path / "train.arrow")
    )
    assert summary.dropped_too_long > 0 and len(written) == summary.examples == len(in_memory)
    names = dataset_files(written, tmp_path)
    assert names == ["train.arrow"]  # a row a record; the dropped ones are left out by an indices mapping
    again = examples_of(read_dataset(tmp_path, names), summary.dropped_indices)
    assert again.to_dict() == in_memory.to_dict() == written.to_dict()
    assert isinstance(again, Dataset) and again.cache_files  # memory-mapped, not loaded


def test_the_digests_follow_what_they_are_given(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    key = tokenizer_digest(tokenizer)
    tokenizer.chat_template = "{{ messages }}"
    assert tokenizer_digest(tokenizer) != key
    tokenizer.pad_token = tokenizer.eos_token
    assert len({key, tokenizer_digest(tokenizer), tokenizer_digest(AutoTokenizer.from_pretrained(tiny_model_dir))}) == 2
    assert digest({"max_length": 64}) == digest({"max_length": 64}) != digest({"max_length": 65})
