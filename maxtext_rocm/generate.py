"""Text generation with a KV cache: one prefill pass over the prompts, then a jitted decode loop.

    python -m maxtext_rocm.generate CHECKPOINT_DIR --prompt "..." [--max-new-tokens N]
        [--temperature T] [--top-k K] [--top-p P] [--seed S]
    python -m maxtext_rocm.generate CHECKPOINT_DIR --chat "question" [--system "..."] [...]

`--chat` (and `chat()` from Python) renders the conversation with the run's chat template
(data/chat_template.py) and its generation prompt, and stops the reply at the template's
end-of-turn token (Llama 3: `<|eot_id|>`) or the tokenizer's EOS.

A LoRA run generates with its adapters applied: `load_params` gives its merged model, on the base
the run recorded (finetune/lora_base.py; another base is refused in one sentence).

Prompts of different lengths are left-padded to one length. Padding gets position -1, which
attention never attends to (models/attention.py), and each real token keeps the position it has
alone, so every prompt of a batch continues as it would alone. The cache holds kv_heads (not
heads) per layer, in the model's "cache" collection; the decode loop runs on the device
(`lax.while_loop`) until every row has produced one of the `eos_id`s or `max_new_tokens` tokens.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import numpy as np
from flax import linen as nn

from maxtext_rocm.config import UserError
from maxtext_rocm.models import build_model
# `sample` stays importable from here, where notebooks and tests found it before models/decoding.py.
from maxtext_rocm.models.decoding import decode_loop, decoding_model_cfg, left_pad, sample  # noqa: F401
from maxtext_rocm.numerics.precision import policy_from_config
from maxtext_rocm.resolve import resolve_here

USAGE = ("python -m maxtext_rocm.generate CHECKPOINT_DIR (--prompt TEXT | --chat TEXT [--system TEXT]) "
         "[--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]")


@functools.lru_cache(maxsize=16)
def _decoder(model_cfg, policy, batch: int, prompt_len: int, max_new: int, temperature: float,
             top_k: int, top_p: float, stop_ids: tuple[int, ...]):
    """The jitted prefill + decode loop for one shape and one sampling setting."""
    model = build_model(model_cfg, policy, decode=True)
    run = decode_loop(model, batch, prompt_len, max_new, temperature, top_k, top_p, stop_ids)
    return jax.jit(lambda variables, tokens, positions, key: run(variables, tokens, positions, key)[:2])


def generate(cfg, params, prompt_tokens, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id=None, pad_to: int = 0, policy=None):
    """Continues each prompt of `prompt_tokens` (a list of token-id sequences, any lengths) by up
    to `max_new_tokens` tokens: greedy at temperature 0, else sampled (top_k, top_p), the same
    for the same seed. A row stops after `eos_id` (an id or several, e.g. a chat's end-of-turn and
    EOS; kept in its output). `pad_to`: left-pad the prompts to at least this length, so that calls
    with prompts of different lengths share one compiled program (evaluation's buckets). Returns one
    int32 array of new tokens per prompt; a single prompt (one sequence of ints) gives one array.
    `params` may also be a model's variables (a training LoRA run's {"params": base, "adapters": ...},
    applied by `policy`, the precision policy to decode with; default cfg.precision's)."""
    single = len(prompt_tokens) > 0 and np.ndim(prompt_tokens[0]) == 0
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in ([prompt_tokens] if single else prompt_tokens)]
    vocab = cfg.model.vocab_size
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    if any(((p < 0) | (p >= vocab)).any() for p in prompts):
        raise UserError(f"prompt token ids must lie in [0, {vocab}) for model.vocab_size={vocab}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UserError(f"temperature={temperature}, top_k={top_k}, top_p={top_p}: need temperature >= 0 "
                        "(0 = greedy), top_k >= 0 (0 = all tokens) and 0 < top_p <= 1")
    params = nn.meta.unbox(params)
    variables = dict(params) if "params" in params else {"params": params}
    stop_ids = tuple(int(i) for i in np.atleast_1d(np.asarray([] if eos_id is None else eos_id, np.int64)))
    tokens, positions = left_pad(prompts, pad_to)
    cfg = resolve_here(cfg, seq_len=tokens.shape[1])
    run = _decoder(decoding_model_cfg(cfg.model), policy_from_config(cfg.precision) if policy is None else policy,
                   len(prompts), tokens.shape[1], int(max_new_tokens), float(temperature), int(min(top_k, vocab)),
                   float(top_p), stop_ids)
    out, steps = jax.device_get(run(variables, tokens, positions, jax.random.key(seed)))
    results = []
    for row in out[:, :steps]:
        stop = np.flatnonzero(np.isin(row, stop_ids)) if stop_ids else []
        results.append(row[:stop[0] + 1] if len(stop) else row)
    return results[0] if single else results


def chat(cfg, params, messages, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
         top_p: float = 1.0, seed: int = 0) -> str:
    """The assistant's reply to `messages` ([{"role", "content"}, ...], or one user question as a
    string): rendered with the run's chat template (data.chat_template, else the tokenizer's own)
    and its generation prompt, generated until the template's end-of-turn token or EOS, decoded."""
    from maxtext_rocm.data.chat_template import encode_rendered, end_of_turn, load_chat_template
    from maxtext_rocm.data.records import check_messages
    from maxtext_rocm.data.tokenizer import load_tokenizer

    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    check_messages(messages, "the chat", need_assistant=False)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    template = load_chat_template(cfg.data, tokenizer)
    prompt = encode_rendered(tokenizer, template.render(messages, add_generation_prompt=True))
    stop = end_of_turn(template, tokenizer).stop_ids
    reply = generate(cfg, params, prompt, max_new_tokens, temperature, top_k, top_p, seed, eos_id=stop)
    return tokenizer.decode(reply[:-1] if len(reply) and reply[-1] in stop else reply)


def main(argv: list[str] | None = None) -> int:
    from maxtext_rocm.api import load_params, run_config
    from maxtext_rocm.data.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m maxtext_rocm.generate", usage=USAGE,
                                     description="Continue a prompt with a trained model.")
    parser.add_argument("checkpoint", help="a run directory, one of its checkpoints/<step>, or an export")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="text to continue")
    given.add_argument("--chat", help="a user's message, answered with the run's chat template")
    parser.add_argument("--system", help="with --chat: a system message before it")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 (default): no limit")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bos", action="store_true",
                        help="start the prompt with the tokenizer's bos token (the default when the run's "
                             "data.source='files' added one to each document)")
    args = parser.parse_args(argv)
    try:
        cfg = run_config(args.checkpoint)
        try:
            tokenizer = load_tokenizer(cfg.data.tokenizer)
        except (OSError, ValueError) as error:
            raise UserError(f"cannot load the run's tokenizer data.tokenizer={cfg.data.tokenizer!r} ({error})") from None
        if args.chat is not None:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            params = load_params(args.checkpoint, cfg)
            print(chat(cfg, params, messages + [{"role": "user", "content": args.chat}], args.max_new_tokens,
                       args.temperature, args.top_k, args.top_p, args.seed))
            return 0
        data = cfg.data
        run_added_bos = data.get("source") == "files" and data.get("add_bos", False)
        prompt = tokenizer.encode(args.prompt, bos=(args.bos or run_added_bos) and tokenizer.bos_id is not None)
        if len(prompt) == 0:
            raise UserError("--prompt is empty; give some text to continue")
        params = load_params(args.checkpoint, cfg)
        new = generate(cfg, params, prompt, args.max_new_tokens, args.temperature, args.top_k,
                       args.top_p, args.seed, tokenizer.eos_id)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(args.prompt + tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
