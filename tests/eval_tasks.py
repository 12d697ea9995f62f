"""Local lm-eval tasks of each request type (a YAML and a JSON Lines file each, nothing
downloaded), shared by the evaluation tests: multiple choice (loglikelihood), whole documents
(loglikelihood_rolling) and generation until a stop string (generate_until)."""
from __future__ import annotations

import json
from pathlib import Path

STOP = "o"  # the generation task's stop string; the test checks that it cuts a generation
TASKS = {
    "tiny_choice": ("multiple_choice", [
        {"question": "What does the quick brown fox jump over?", "choices": [" the lazy dog", " the moon", " a fence"],
         "answer": 0},
        {"question": "Say hello.", "choices": [" hello world", " goodbye"], "answer": 0},
        {"question": "What is 2+2?", "choices": [" four", " five", " the answer is four"], "answer": 2}]),
    "tiny_text": ("loglikelihood_rolling", [{"text": "the quick brown fox jumps over the lazy dog. " * 6},
                                            {"text": "hello world, hello tokenizer. " * 2}]),
    "tiny_gen": ("generate_until", [{"prompt": "the quick brown", "answer": " fox"},
                                    {"prompt": "hello", "answer": " world"}, {"prompt": "What is", "answer": " four"}]),
}
TASK_KEYS = {
    "multiple_choice": 'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
                       'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
    "loglikelihood_rolling": 'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
                             '  - metric: byte_perplexity\n  - metric: bits_per_byte\n',
    "generate_until": f'doc_to_text: "{{{{prompt}}}}"\ndoc_to_target: "{{{{answer}}}}"\ngeneration_kwargs:\n'
                      f'  until: ["{STOP}"]\n  max_gen_toks: 12\n  do_sample: false\nmetric_list:\n'
                      '  - metric: exact_match\n',
}


def write_tasks(folder: Path, tasks: dict = TASKS) -> Path:
    """One YAML + one JSON Lines file per task of `tasks` (name: (output type, documents)), as a
    user writes a local task."""
    folder.mkdir(parents=True)
    for name, (kind, docs) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: {kind}\n{TASK_KEYS[kind]}")
    return folder
