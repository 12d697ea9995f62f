"""Requests per second of maxtext_rocm.eval against lm-eval's own `hf` backend, on the same model,
in one run: the tiny Llama of tests/test_eval_harness.py (made by transformers, imported with
`convert from-hf`), scored on the tests' local tasks (tests/eval_tasks.py) with more documents,
one request type per task.

    python scripts/eval_speed.py [--docs=64] [--batch-size=16] [--hidden=64] [--layers=2]

Both backends run in fp32 on the host's CPU (one JAX device; torch with its default threads), at
the same batch size, each task once to warm up (our programs compile there) and once timed. A
request is one of lm-eval's Instances: a choice of a multiple-choice document, a whole document of
the rolling task, a generation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tokenizer and tasks

from chat_helpers import make_chat_tokenizer  # noqa: E402
from eval_tasks import TASKS, write_tasks  # noqa: E402

KINDS = {"tiny_choice": "loglikelihood", "tiny_text": "loglikelihood_rolling", "tiny_gen": "generate_until"}


def more_documents(n: int) -> dict:
    """The tests' tasks with `n` documents each: theirs, numbered so that no two are the same text."""
    out = {}
    for name, (kind, docs) in TASKS.items():
        grown = []
        for i in range(n):
            doc = dict(docs[i % len(docs)])
            key = {"multiple_choice": "question", "loglikelihood_rolling": "text", "generate_until": "prompt"}[kind]
            doc[key] = f"{i} {doc[key]}"
            grown.append(doc)
        out[name] = (kind, grown)
    return out


def make_llama(folder: Path, hidden: int, layers: int) -> Path:
    import torch
    import transformers

    make_chat_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
                                      eos_token_id=[1, 4])
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.15)
    model.eval().save_pretrained(folder)
    return folder


def timed(model: str, model_args: dict, task: str, tasks_dir: Path, batch_size: int) -> tuple[int, float]:
    """(requests, seconds) of one timed evaluation of `task`, after one that warms up."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    for attempt in range(2):
        started = time.perf_counter()
        results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], batch_size=batch_size,
                                          task_manager=manager, log_samples=True, bootstrap_iters=0)
        seconds = time.perf_counter() - started
    requests = sum(len(sample["arguments"]) for sample in results["samples"][task])
    return requests, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=64, help="documents per task (default 64)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per forward pass, both backends (default 16)")
    parser.add_argument("--hidden", type=int, default=64, help="the model's hidden size (default 64, the tests')")
    parser.add_argument("--layers", type=int, default=2, help="the model's layers (default 2, the tests')")
    args = parser.parse_args()

    import maxtext_rocm.eval.model  # noqa: F401  registers "maxtext_rocm"
    from maxtext_rocm.convert.__main__ import main as convert_main

    root = Path(tempfile.mkdtemp(prefix="eval_speed_"))
    make_llama(root / "hf", args.hidden, args.layers)
    assert convert_main(["from-hf", str(root / "hf"), str(root / "export")]) == 0
    write_tasks(root / "tasks", more_documents(args.docs))
    backends = {
        "ours": ("maxtext_rocm", {"run": str(root / "export"), "precision": "fp32", "max_length": 64}),
        "hf": ("hf", {"pretrained": str(root / "hf"), "dtype": "float32", "max_length": 64, "device": "cpu"}),
    }
    print(f"\n{args.docs} documents per task, batch {args.batch_size}, hidden {args.hidden}, {args.layers} layers, "
          "fp32, CPU\n")
    print("| request type | requests | ours (req/s) | hf (req/s) | ours / hf |")
    print("|---|---|---|---|---|")
    for task, kind in KINDS.items():
        rates = {}
        for name, (model, model_args) in backends.items():
            requests, seconds = timed(model, model_args, task, root / "tasks", args.batch_size)
            rates[name] = requests / seconds
        print(f"| {kind} | {requests} | {rates['ours']:.0f} | {rates['hf']:.1f} | {rates['ours'] / rates['hf']:.1f}x |",
              flush=True)


if __name__ == "__main__":
    main()
