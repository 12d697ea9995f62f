#!/usr/bin/env python
"""The Hugging Face side of scripts/compare_trl.py. It runs in the Python that has TRL (its own
virtual environment: TRL is never a dependency of maxtext_rocm) and never imports maxtext_rocm.

    python scripts/compare_trl_worker.py prepare OUT [--quick] [--seed 0]
        OUT/hf/: a Llama made by transformers (seeded, fp32 safetensors) with a byte-level BPE
        tokenizer and Llama 3's chat template (with transformers' {% generation %} marks, which
        TRL's assistant_only_loss needs); OUT/chats.jsonl: multi-turn chats; OUT/pairs.jsonl:
        preference pairs (prompt as messages, chosen and rejected as strings); OUT/prepare.json:
        what was made (sizes, token lengths). Needs torch, transformers and tokenizers only.
    python scripts/compare_trl_worker.py train PREP MODE --order FILE --steps N ... --result FILE
        MODE sft_packed | sft_unpacked | dpo_lora | dpo_full: TRL's SFTTrainer (packing=True,
        packing=False) or DPOTrainer (PEFT LoRA on all seven projections, or every parameter),
        writing each step's wall time, real tokens and loss to --result as JSON.

Real tokens are counted as maxtext_rocm counts them (positions holding a token, each with a
next-token target): a sequence of n tokens counts n - 1, padding counts nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

# Llama 3's chat template with transformers' {% generation %} marks around what the assistant
# writes (its content and <|eot_id|>): the tokens both trainers train on.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|finetune_right_pad_id|>"]
NAMES = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|finetune_right_pad_id|>"}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# The setup (#51), and a tiny one that runs in a minute. chat_median and pair_median are
# the medians of the lengths aimed at (lognormal, clipped to [min_len, max_len]); a chat ends a few
# tokens short of its aim, so 233 gives a median of about 221.
SIZES = {
    "full": dict(vocab=8192, d_model=512, layers=8, heads=8, kv_heads=4, mlp=2048, chats=3000, pairs=2000,
                 chat_median=233, pair_median=177, min_len=34, max_len=512, words=6000),
    "quick": dict(vocab=512, d_model=64, layers=2, heads=4, kv_heads=2, mlp=128, chats=48, pairs=32,
                  chat_median=60, pair_median=50, min_len=20, max_len=128, words=300),
}


# ---------------------------------------------------------------- prepare: model, tokenizer, data

def pseudo_words(rng: random.Random, count: int) -> list[str]:
    """`count` distinct pronounceable words of 1 to 4 syllables."""
    onsets, vowels, codas = "b c d f g h j k l m n p r s t v w z br st pl gr sh th".split(), "a e i o u ai ou".split(), \
        ["", "", "n", "r", "s", "t", "l", "m"]
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                          for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 4)))))
    return sorted(words)


class Text:
    """Sentences of Zipf-distributed words, seeded."""

    def __init__(self, rng: random.Random, words: list[str]):
        self.rng, self.words = rng, words
        self.weights = [1.0 / (rank + 10) for rank in range(len(words))]

    def words_of(self, n: int) -> list[str]:
        return self.rng.choices(self.words, self.weights, k=n)

    def sentence(self, n: int) -> str:
        out, words = [], self.words_of(max(1, n))
        for i, word in enumerate(words):
            out.append(word.capitalize() if i == 0 or out[-1].endswith(".") else word)
            if i + 1 < len(words) and self.rng.random() < 0.1:
                out[-1] += self.rng.choice((".", ",", "?"))
        return " ".join(out) + "."


def make_tokenizer(folder: Path, text: Text, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((text.sentence(text.rng.randint(5, 40)) for _ in range(20000)), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **NAMES, "model_max_length": 4096,
         "chat_template": CHAT_TEMPLATE}))
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **NAMES)


def length_of(tokenizer, messages: list[dict]) -> int:
    """Tokens of the conversation as both trainers tokenize it (the rendered template, its special
    tokens read as tokens)."""
    rendered = tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False)
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def target_length(rng: random.Random, median: float, lo: int, hi: int) -> int:
    """Lognormal around `median`, clipped to [lo, hi]."""
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, 0.55))))))


def fit_turn(tokenizer, before: list[dict], role: str, words: list[str], target: int) -> str | None:
    """The longest prefix of `words` (at least one) that, as the next `role` turn after `before`,
    keeps the conversation within `target` tokens; None when even one word does not."""
    lo, hi, best = 1, len(words), None
    while lo <= hi:
        mid = (lo + hi) // 2
        if length_of(tokenizer, before + [{"role": role, "content": " ".join(words[:mid]) + "."}]) <= target:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return None if best is None else " ".join(words[:best]) + "."


def make_chat(tokenizer, text: Text, target: int) -> list[dict]:
    """A multi-turn chat (an optional system message, then user and assistant turns) of `target`
    tokens or a few fewer, never more."""
    rng = text.rng
    system = rng.random() < 0.3 and target >= 80
    messages = [{"role": "system", "content": text.sentence(rng.randint(3, 12))}] if system else []
    length = length_of(tokenizer, messages) if messages else 1
    while length < target - 4:
        # a user turn that leaves room for a reply (a word is a token or two)
        user = {"role": "user", "content": text.sentence(min(rng.randint(3, 30), max(1, (target - length) // 5)))}
        reply = fit_turn(tokenizer, messages + [user], "assistant", text.words_of(rng.randint(5, 90)), target)
        if reply is None:
            break
        messages += [user, {"role": "assistant", "content": reply}]
        length = length_of(tokenizer, messages)
    return messages


def make_pair(tokenizer, text: Text, target: int, max_len: int) -> dict:
    """A prompt (one user turn, sometimes an exchange before it) of a fifth to a half of `target`
    tokens, a chosen reply that brings the pair to `target` tokens and a rejected one of another
    length, neither over `max_len`."""
    rng = text.rng
    prompt = []
    if rng.random() < 0.25:
        prompt += [{"role": "user", "content": text.sentence(rng.randint(2, 8))},
                   {"role": "assistant", "content": text.sentence(rng.randint(2, 8))}]
    budget = max((length_of(tokenizer, prompt) if prompt else 1) + 8, round(target * rng.uniform(0.2, 0.5)))
    prompt.append({"role": "user", "content": fit_turn(tokenizer, prompt, "user", text.words_of(budget), budget)
                   or text.sentence(1)})
    replies = []
    for goal in (target, min(max_len, round(target * rng.uniform(0.6, 1.4)))):
        replies.append(fit_turn(tokenizer, prompt, "assistant", text.words_of(max(4, goal)), goal)
                       or text.sentence(1))
    return {"prompt": prompt, "chosen": replies[0], "rejected": replies[1]}


def spread(lengths: list[int]) -> dict:
    return {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
            "total": sum(lengths), "count": len(lengths)}


def prepare(out: Path, size: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SIZES[size]
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    text = Text(rng, pseudo_words(rng, s["words"]))
    tokenizer = make_tokenizer(hf, text, s["vocab"])

    chats = []
    while len(chats) < s["chats"]:
        chat = make_chat(tokenizer, text, target_length(rng, s["chat_median"], s["min_len"], s["max_len"]))
        if any(m["role"] == "assistant" for m in chat) and length_of(tokenizer, chat) >= s["min_len"]:
            chats.append(chat)
    pairs = [make_pair(tokenizer, text, target_length(rng, s["pair_median"], s["min_len"], s["max_len"]), s["max_len"])
             for _ in range(s["pairs"])]
    (out / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))

    ids = lambda name: tokenizer.convert_tokens_to_ids(NAMES[name])  # noqa: E731
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["d_model"], intermediate_size=s["mlp"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], max_position_embeddings=4 * s["max_len"],
                         tie_word_embeddings=False, bos_token_id=ids("bos_token"), eos_token_id=ids("eos_token"),
                         pad_token_id=ids("pad_token"))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(hf)
    chosen = [length_of(tokenizer, p["prompt"] + [{"role": "assistant", "content": p["chosen"]}]) for p in pairs]
    rejected = [length_of(tokenizer, p["prompt"] + [{"role": "assistant", "content": p["rejected"]}]) for p in pairs]
    summary = {"size": size, "seed": seed, "parameters": sum(p.numel() for p in model.parameters()),
               "model": {k: s[k] for k in ("vocab", "d_model", "layers", "heads", "kv_heads", "mlp")},
               "seq_len": s["max_len"], "chat_tokens": spread([length_of(tokenizer, c) for c in chats]),
               "pair_tokens": {"chosen": spread(chosen), "rejected": spread(rejected)}}
    (out / "prepare.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


# ---------------------------------------------------------------- train: TRL on the same work

def real_tokens(inputs: dict) -> int:
    """Positions holding a token with a next-token target: n - 1 for each sequence of n tokens.
    (Tensors or NumPy arrays alike.)"""
    if "attention_mask" in inputs:  # padded rows, one sequence each
        mask = inputs["attention_mask"]
        return int(mask.sum()) - int(mask.shape[0])
    positions = inputs["position_ids"].reshape(-1)  # padding-free: one flattened row, each sequence from 0
    return int(positions.shape[0]) - int((positions == 0).sum())


def train(args) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.manual_seed(args.seed)
    prep = Path(args.prep)
    sft = args.mode.startswith("sft")
    tokenizer = AutoTokenizer.from_pretrained(prep / "hf")
    model = AutoModelForCausalLM.from_pretrained(prep / "hf", dtype=torch.float32)
    dataset = load_dataset("json", data_files=str(prep / ("chats.jsonl" if sft else "pairs.jsonl")), split="train")
    # maxtext_rocm's order of the records (its first epoch's permutation), read front to back
    dataset = dataset.select(json.loads(Path(args.order).read_text()))
    common = dict(output_dir=args.workdir, max_steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup_steps,
                  lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio},
                  adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=args.weight_decay,
                  max_grad_norm=1.0, bf16=args.dtype == "bf16", use_cpu=True, logging_steps=1, save_strategy="no",
                  report_to="none", disable_tqdm=True, seed=args.seed, data_seed=args.seed, max_length=args.seq_len,
                  dataloader_num_workers=0)
    if sft:
        from trl import SFTConfig, SFTTrainer

        packed = args.mode == "sft_packed"
        # packed rows from the whole dataset come in TRL's (seeded, random) order; one conversation
        # per row reads maxtext_rocm's order, so the two runs see the same batches
        config = SFTConfig(**common, per_device_train_batch_size=4, packing=packed, assistant_only_loss=True,
                           train_sampling_strategy="random" if packed else "sequential")
        trainer_cls, extra = SFTTrainer, {}
    else:
        from trl import DPOConfig, DPOTrainer

        def conversational(pair):
            return {"chosen": [{"role": "assistant", "content": pair["chosen"]}],
                    "rejected": [{"role": "assistant", "content": pair["rejected"]}]}

        dataset = dataset.map(conversational)
        config = DPOConfig(**common, per_device_train_batch_size=2, beta=0.1, train_sampling_strategy="sequential")
        trainer_cls, extra = DPOTrainer, {}
        if args.mode == "dpo_lora":
            from peft import LoraConfig

            extra["peft_config"] = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS,
                                              task_type="CAUSAL_LM")

    steps: list[dict] = []

    class Counting(trainer_cls):
        def training_step(self, model, inputs, *rest, **kwargs):
            steps.append({"step": len(steps) + 1, "tokens": real_tokens(inputs)})
            return super().training_step(model, inputs, *rest, **kwargs)

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            self.last = time.perf_counter()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            steps[-1]["time_s"], self.last = now - self.last, now

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "loss" in logs and state.global_step <= len(steps):
                steps[state.global_step - 1]["loss"] = float(logs["loss"])

    trainer = Counting(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                       callbacks=[Clock()], **extra)
    trainer.train()
    Path(args.result).write_text(json.dumps({"mode": args.mode, "steps": steps, "torch_threads": torch.get_num_threads()}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train")
    t.add_argument("prep")
    t.add_argument("mode", choices=["sft_packed", "sft_unpacked", "dpo_lora", "dpo_full"])
    for name, kind in (("--order", str), ("--result", str), ("--workdir", str), ("--steps", int), ("--seq-len", int),
                       ("--warmup-steps", int), ("--lr", float)):
        t.add_argument(name, type=kind, required=True)
    t.add_argument("--min-lr-ratio", type=float, default=0.1)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    t.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(Path(args.out), "quick" if args.quick else "full", args.seed)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
