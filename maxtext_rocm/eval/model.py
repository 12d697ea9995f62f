"""The run's own model as an lm-evaluation-harness model, registered as "maxtext_rocm".

    import maxtext_rocm.eval.model  # registers it
    lm_eval.simple_evaluate(model="maxtext_rocm", model_args={"run": "runs/tiny_llama"}, tasks=[...])

Model arguments (`--model_args run=RUN,batch_size=16,...`):
  run             a run directory, one of its checkpoints/<step>, or a params export (required);
                  its parameters are verified as every checkpoint reader verifies them and read into
                  their shardings on the run's own mesh (eval/placement.py; a LoRA run's adapters
                  applied inside the dots), else placed as load_params places them (a LoRA run merged)
  mesh.ici.fsdp=4, mesh.ici.tensor=2, ...
                  a mesh to evaluate on instead (config keys mesh.*, checked as training checks them)
  batch_size      rows per forward pass (default 16; "auto" is not measured here and means 16)
  max_length      the window in tokens (default the run's train.seq_len)
  max_gen_toks    generate_until's default budget (default 256, as the `hf` backend's)
  add_bos_token   true/false: force a BOS before every text (default: eval/text.py's rules)
  precision       a precision.policy for the evaluation (fp32, bf16, ...; default the run's)

From Python (the in-training harness, eval/in_training.py) the model may also be given whole:
`params` (a params tree, or the model's variables: a training LoRA run's frozen base and adapters)
with its `cfg`, the `policy` that applies them, the `mesh` they lie on, and `progress=False`.

The three request types: `loglikelihood` (lm-eval's TemplateLM splits context and continuation
as the `hf` backend does; eval/scoring.py scores them in fixed shapes), `loglikelihood_rolling`
(lm-eval's own windows of max_length tokens, context 1, each scored as a continuation) and
`generate_until` (the KV-cache sampler of maxtext_rocm.generate; the stop strings cut the decoded
text, the run's end-of-text ids stop the sampler).
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import jax
import ml_collections
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from maxtext_rocm.errors import UserError
from maxtext_rocm.eval.scoring import Scorer, ScoredRow, bucket_for
from maxtext_rocm.eval.text import TextCodec
from maxtext_rocm.parallel import sharding

DEFAULT_BATCH = 16
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's `hf` backend's


def _flag(value, name: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise UserError(f"model argument {name}={value!r} is not true or false")


def _positive(value, name: str, default: int) -> int:
    if value is None or str(value).startswith("auto"):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise UserError(f"model argument {name}={value!r} must be a positive whole number")
    return number


def stop_token_ids(run, cfg, tokenizer) -> tuple[int, ...]:
    """Where generation ends: the tokenizer's EOS and the eos_token_id of the generation_config.json
    that `convert to-hf` writes for this run (the original's, plus a chat run's end-of-turn), so the
    sampler stops where transformers' generate stops on the export."""
    from pathlib import Path

    from maxtext_rocm.convert.hf_config import ConvertError
    from maxtext_rocm.convert.origin import find_origin, find_record, generation_config

    ids = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
    try:
        generation = generation_config(find_origin(find_record(Path(run).absolute())[0]), cfg) or {}
    except ConvertError:
        generation = {}
    eos = generation.get("eos_token_id")
    for token in [] if eos is None else [eos] if isinstance(eos, int) else eos:
        if int(token) not in ids:
            ids.append(int(token))
    return tuple(ids)


@register_model("maxtext_rocm")
class MaxTextLM(TemplateLM):
    """lm-eval's LM over a run's parameters and forward pass (see the module's docstring)."""

    def __init__(self, run: str | None = None, batch_size: int | str | None = None, max_length: int | None = None,
                 max_gen_toks: int | None = None, add_bos_token: bool | str | None = None,
                 precision: str | None = None, seed: int = 0, params=None, cfg=None, policy=None, mesh=None,
                 progress: bool = True, **unused: Any):
        super().__init__()
        from maxtext_rocm.api import run_config
        from maxtext_rocm.eval import placement

        if run is None and (params is None or cfg is None):
            raise UserError("the maxtext_rocm model needs run=RUN (a run directory, one of its "
                            "checkpoints/<step>, or a params export) in --model_args")
        self.run = None if run is None else str(run)
        self.cfg = run_config(self.run) if cfg is None else cfg
        mesh_args = placement.mesh_overrides(unused)
        if params is None:  # a saved run: on its own mesh or the one mesh_args give (eval/placement.py)
            placed = placement.place(self.run, self.cfg, mesh_args, precision)
            if placed.note and jax.process_index() == 0:
                print(f"note: {placed.note}", file=sys.stderr, flush=True)
            self.cfg, params, policy, mesh = placed.cfg, placed.variables, placed.policy, placed.mesh
        elif mesh_args:
            raise UserError(f"model argument {next(iter(mesh_args))} places a run read from run=RUN; parameters "
                            "given whole stay where they lie")
        elif precision is not None:
            self.cfg = ml_collections.ConfigDict(self.cfg.to_dict())
            self.cfg.precision.policy = str(precision)
        self.batch_size = _positive(batch_size, "batch_size", DEFAULT_BATCH)
        self.max_length = _positive(max_length, "max_length", int(self.cfg.train.seq_len))
        self.max_gen_toks = _positive(max_gen_toks, "max_gen_toks", DEFAULT_MAX_GEN_TOKS)
        self.seed = int(seed)
        self.codec = TextCodec.for_run(self.cfg, _flag(add_bos_token, "add_bos_token"))
        # Where the run's record is (a training run's output_dir), its stop ids are an export's.
        record = self.run or self.cfg.get("output_dir")
        self.stop_ids = stop_token_ids(record, self.cfg, self.codec.tokenizer) if record else (
            () if self.codec.tokenizer.eos_id is None else (int(self.codec.tokenizer.eos_id),))
        self.params, self.policy, self.mesh, self.progress = params, policy, mesh, progress
        self.scorer = Scorer(self.cfg, params, self.batch_size, self.max_length, policy=policy, mesh=mesh)
        self.batch_size = self.scorer.batch_size  # a multiple of the mesh's batch shards

    # -- what TemplateLM needs ------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.codec.tokenizer.eos_id
        return self.codec.tokenizer.bos_id if eos is None else eos

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window condition on: BOS, else EOS (as `hf`)."""
        bos = self.codec.tokenizer.bos_id
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return str(self.cfg.data.tokenizer).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.codec.encode(string, add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation), context ids, continuation ids) -> (log p, is greedy), the
        input cut on the left to max_length as the `hf` backend cuts it."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append(ScoredRow(whole, min(len(continuation), len(whole) - 1)))
        results = []
        quiet = disable_tqdm or not self.progress
        with tqdm(total=len(rows), disable=quiet, desc="maxtext_rocm log-likelihoods") as bar:
            step = self.batch_size * 8  # one progress update per few batches
            for start in range(0, len(rows), step):
                for request, score in zip(requests[start:start + step], self.scorer(rows[start:start + step])):
                    results.append((score.logprob, score.greedy))
                    if request[0] is not None:
                        self.cache_hook.add_partial("loglikelihood", request[0], results[-1])
                bar.update(min(step, len(rows) - start))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)  # its tokenizing bar

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from maxtext_rocm.generate import generate

        by_settings: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            by_settings.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        out: list[str | None] = [None] * len(requests)
        eos_text = self.codec.special_text(self.eot_token_id)
        bar = tqdm(total=len(requests), disable=disable_tqdm or not self.progress, desc="maxtext_rocm generate_until")
        for indices in by_settings.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - max_new
            if room < 1:
                raise UserError(f"max_gen_toks={max_new} leaves no room for a prompt in max_length={self.max_length}")
            sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
            prompts = {i: (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-room:] for i in indices}
            ordered = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(ordered), self.batch_size):
                chunk = ordered[start:start + self.batch_size]
                rows = [prompts[i] for i in chunk]
                rows += [rows[-1]] * (self.batch_size - len(rows))  # a fixed batch: one program per bucket
                with self._mesh_rules():
                    new = generate(self.cfg, self.params, rows, max_new,
                                   temperature=float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
                                   top_k=int(kwargs.get("top_k") or 0) if sampled else 0,
                                   top_p=float(kwargs.get("top_p") or 1.0) if sampled else 1.0,
                                   seed=self.seed + start, eos_id=self.stop_ids,
                                   pad_to=bucket_for(len(rows[0]), room), policy=self.policy)
                for i, tokens in zip(chunk, new):
                    text = postprocess_generated_text(self.codec.decode(tokens), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return out

    def _mesh_rules(self):
        """The mesh and logical-axis rules the model's sharding constraints resolve against, where
        the parameters lie on a mesh (its batch rows then split as a training batch's)."""
        return contextlib.nullcontext() if self.mesh is None else sharding.rules_context(self.mesh)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """`--apply_chat_template`: the run's chat template (data.chat_template, else the tokenizer's)."""
        from maxtext_rocm.data.chat_template import load_chat_template

        template = load_chat_template(self.cfg.data, self.codec.tokenizer)
        return template.render(chat_history, add_generation_prompt=add_generation_prompt)
