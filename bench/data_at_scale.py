"""The data pipeline at real sizes: records/s and peak memory before and after it moved to `datasets.map`, side by side.

    python bench/data_at_scale.py                    # 50k and 500k one-turn records, 2k and 50k chained, 100k launched
    python bench/data_at_scale.py --before dc333fc   # the commit whose pipeline is "before" (the default)
    python bench/data_at_scale.py --quick            # small sizes, "after" only (the suite runs this)

The records are the shared English and Chinese Alpaca sets repeated (each copy's instruction numbered) and written as
JSON Lines; conversations are the same records chained into 2-4 turns (ShareGPT). Each figure is one fresh process:
it imports, loads the tokenizer, then reads the file and tokenizes as the recipe does ("before": the code of the
`--before` commit, exported with `git archive`; "after": this tree, writing the examples to a file with one process a
core). Peak RSS above the imports is the process's high-water mark less its RSS once the tokenizer is loaded; with
worker processes, the largest worker's own peak is shown too (it shares the parent's imported pages). The launch
runs `hf-scale train --max_steps 1` on the tiny default with a fresh cache, and again on the cache it left.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
MAX_LENGTH = 1024
SETS = ("alpaca_en_demo.json", "alpaca_zh_demo.json")
HEADER = "| data | items | pipeline | load s | tokenize s | items/s | peak RSS above imports MB | largest worker MB |"


def rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (the high-water mark) of this process, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def measure(kind: str, path: str, tokenizer_dir: str, workdir: str) -> dict:
    """One measurement in this process (whichever hf_scale is on the path): read and tokenize the file."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    from hf_scale.data import loading, multiturn
    from hf_scale.data.templates import get_template
    from hf_scale.data.tokenize import tokenize_records

    after = "cache_file_name" in tokenize_records.__code__.co_varnames
    if after:
        from hf_scale.recipes.preparation import PARALLEL_RECORDS  # imported before the clock starts

    def after_options(workdir: str, items: int) -> dict:
        """As the recipe tokenizes: into a file, with one process a core for large sets."""
        if not after:
            return {}
        num_proc = len(os.sched_getaffinity(0)) if items >= PARALLEL_RECORDS else None
        return {"num_proc": num_proc, "cache_file_name": f"{workdir}/train.arrow"}

    base = rss_mb("VmRSS")
    start = time.perf_counter()
    if kind == "records":
        records, _ = loading.load_records(path)
        loaded = time.perf_counter()
        options = after_options(workdir, len(records))
        if after:  # as the recipe does: the records written out and memory-mapped, the loaded copy let go
            records = records.flatten_indices(cache_file_name=f"{workdir}/records.arrow")
        dataset, summary = tokenize_records(records, tokenizer, get_template("alpaca"), MAX_LENGTH, **options)
        count = summary.records
    else:
        from hf_scale.data.conversations import load_conversations

        conversations, _ = load_conversations(path)
        loaded = time.perf_counter()
        options = after_options(workdir, len(conversations))
        if after:
            conversations = conversations.flatten_indices(cache_file_name=f"{workdir}/records.arrow")
        template = multiturn.chat_template_for("llama2_chat", tokenizer)
        dataset, summary = multiturn.tokenize_conversations(conversations, tokenizer, template, MAX_LENGTH, **options)
        count = summary.conversations
    end = time.perf_counter()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "items": count,
        "examples": len(dataset),
        "tokens": summary.tokens,
        "load_s": loaded - start,
        "tokenize_s": end - loaded,
        "total_s": end - start,
        "peak_above_imports_mb": rss_mb("VmHWM") - base,
        "largest_worker_peak_mb": children,
    }


def run_worker(tree: Path, kind: str, path: Path, tokenizer_dir: Path) -> dict:
    """`measure` in a fresh process with `tree`'s hf_scale first on the path."""
    with tempfile.TemporaryDirectory(dir=path.parent) as workdir:
        command = [sys.executable, __file__, "--worker", kind, str(path), str(tokenizer_dir), workdir]
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}", "TOKENIZERS_PARALLELISM": "true"}
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree)
    if result.returncode:
        raise RuntimeError(f"{kind} {path.name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def launch(tree: Path, path: Path, cache: Path) -> dict:
    """`hf-scale train --max_steps 1` on the file, as the issue measured it: wall time and the process's peak RSS."""
    command = [sys.executable, "-m", "hf_scale.cli", "train", "--dataset", str(path), "--max_steps", "1"]
    command += ["--eval_strategy", "no", "--eval_ratio", "0.01", "--exact_match_samples", "0", "--save_strategy", "no"]
    command += ["--output_dir", str(cache / "run"), "--report_to", "none"]
    script = (
        "import resource, subprocess, sys, time, json; start = time.perf_counter(); "
        "code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode; "
        "print(json.dumps({'code': code, 'wall_s': time.perf_counter() - start, "
        "'peak_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))"
    )
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_SCALE_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script, *command], capture_output=True, text=True, env=env, cwd=tree)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    if figures["code"]:
        raise RuntimeError(f"the launch failed ({figures['code']}):\n{result.stderr[-3000:]}")
    return figures


def write_records(path: Path, count: int) -> None:
    """`count` records: the shared sets over and over, each copy's instruction numbered so that no two are equal."""
    shared = [
        record
        for name in ("alpaca_en_demo.json", "alpaca_zh_demo.json")
        for record in json.loads((DATA / name).read_text())
    ]
    with path.open("w") as out:
        for index in range(count):
            record = shared[index % len(shared)]
            numbered = {**record, "instruction": f"{record['instruction']} ({index // len(shared)})"}
            out.write(json.dumps(numbered, ensure_ascii=False) + "\n")


def write_conversations(path: Path, records_path: Path, count: int) -> None:
    """The first `count` records chained into 2-4-turn ShareGPT conversations."""
    from hf_scale.data.conversations import chain_conversations

    records = [json.loads(line) for _, line in zip(range(count), records_path.open(), strict=False)]
    speaker = {"user": "human", "assistant": "gpt"}
    with path.open("w") as out:
        for turns in chain_conversations(records):
            chat = [{"from": speaker[turn["role"]], "value": turn["content"]} for turn in turns]
            out.write(json.dumps({"conversations": chat}, ensure_ascii=False) + "\n")


def export_tree(ref: str, folder: Path) -> Path:
    """The hf_scale package of commit `ref`, exported into `folder`."""
    archive = subprocess.run(["git", "archive", ref, "hf_scale"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="dc333fc", help="the commit whose pipeline is 'before'")
    parser.add_argument("--quick", action="store_true", help="small sizes, 'after' only")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(measure(*options.worker)))
        return
    from transformers import AutoTokenizer

    from hf_scale.tiny import ensure_tiny_model
    from hf_scale.tiny.build import build_sentencepiece_tokenizer

    if options.quick:
        record_sizes, conversation_sizes, launch_size, before_up_to = [2_000], [600, 3_000], 5_000, 0
    else:
        record_sizes, conversation_sizes, launch_size, before_up_to = (
            [50_000, 500_000],
            [2_000, 50_000],
            100_000,
            100_000,
        )
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        trees = {"after": REPO}
        if before_up_to:
            trees = {"before": export_tree(options.before, Path(tempfile.mkdtemp(dir=scratch))), **trees}
        # LLaMA-2's kind of tokenizer (SentencePiece-style BPE, byte fallback), trained on the shared sets.
        texts = [
            " ".join(r.values())
            for n in ("alpaca_en_demo.json", "alpaca_zh_demo.json")
            for r in json.loads((DATA / n).read_text())
        ]
        tokenizer_dir = scratch / "tokenizer"
        build_sentencepiece_tokenizer(texts, vocab_size=8000).save_pretrained(tokenizer_dir)
        largest = max(record_sizes + [launch_size])
        records_path = scratch / "all_records.jsonl"
        write_records(records_path, largest)
        print(
            f"tokenizer: SentencePiece-style BPE, vocabulary {len(AutoTokenizer.from_pretrained(tokenizer_dir))}; "
            f"max_length {MAX_LENGTH}; {os.cpu_count()} cores"
        )
        print(HEADER)
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        rates = {}
        cases = [("records", size) for size in record_sizes] + [("conversations", size) for size in conversation_sizes]
        for kind, size in cases:
            path = scratch / f"{kind}_{size}.jsonl"
            if kind == "records":
                with records_path.open() as source, path.open("w") as out:
                    out.writelines(line for _, line in zip(range(size), source, strict=False))
            else:
                write_conversations(path, records_path, size)
            for name, tree in trees.items():
                if name == "before" and size > before_up_to:
                    print(f"| {kind} | {size} | before | not run: about {size / 50_000 * 2.8:.0f} GB extrapolated |")
                    continue
                figures = run_worker(tree, kind, path, tokenizer_dir)
                rate = size / figures["total_s"]  # records (chained into conversations: record pairs) per second
                rates[kind, size, name] = rate
                print(
                    f"| {kind} of {size} records | {figures['items']} | {name} | {figures['load_s']:.1f} | "
                    f"{figures['tokenize_s']:.1f} | {rate:.0f} | {figures['peak_above_imports_mb']:.0f} | "
                    f"{figures['largest_worker_peak_mb']:.0f} |",
                    flush=True,
                )
            path.unlink()
        for kind, size in cases:
            if (kind, size, "before") in rates:
                ratio = rates[kind, size, "after"] / rates[kind, size, "before"]
                print(f"{kind} of {size} records: after / before records/s {ratio:.2f}x")
        small, large = conversation_sizes
        print(
            f"conversations, after: record pairs/s at {large} / at {small}: "
            f"{rates['conversations', large, 'after'] / rates['conversations', small, 'after']:.2f}"
        )
        launch_path = scratch / f"launch_{launch_size}.jsonl"
        with records_path.open() as source, launch_path.open("w") as out:
            out.writelines(line for _, line in zip(range(launch_size), source, strict=False))
        tiny = ensure_tiny_model()
        print(f"\n| hf-scale train --max_steps 1 on {launch_size} records | wall s | peak RSS MB |")
        print("| --- | --- | --- |")
        for name, tree in trees.items():
            cache = Path(tempfile.mkdtemp(dir=scratch))
            shutil.copytree(tiny, cache / tiny.name)  # the tiny model is built already, as on a second run
            runs = [("fresh cache", launch(tree, launch_path, cache))]
            if name == "after":
                runs.append(("relaunch", launch(tree, launch_path, cache)))
            for label, figures in runs:
                print(f"| {name}, {label} | {figures['wall_s']:.1f} | {figures['peak_rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
