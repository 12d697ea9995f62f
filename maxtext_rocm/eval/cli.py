"""`python -m maxtext_rocm.eval RUN_OR_EXPORT --tasks T1,T2 [...]`: lm-evaluation-harness's
`simple_evaluate` on a run's own model, with lm-eval's flag names, its results table on stdout and
its results file (`OUTPUT_PATH/<run name>/results_<time>.json`, plus `samples_<task>_<time>.jsonl`
with --log_samples), as `lm_eval --output_path` writes them.

The model is placed on the run's own mesh, or on the one `--config.mesh.*` flags give (checked as
training checks them, before lm-eval indexes its tasks): eval/placement.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from maxtext_rocm.errors import UserError
from maxtext_rocm.eval.tasks import not_installed, task_manager

USAGE = ("python -m maxtext_rocm.eval RUN_OR_EXPORT --tasks T1,T2 [--include_path DIR] [--limit N] "
         "[--num_fewshot K] [--batch_size B] [--output_path DIR] [--log_samples] [--apply_chat_template] "
         "[--model_args KEY=VALUE,...] [--config.mesh.ici.AXIS=N ...]")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m maxtext_rocm.eval", usage=USAGE,
                                     description="Evaluate a run with lm-evaluation-harness tasks.")
    parser.add_argument("run", help="a run directory, one of its checkpoints/<step>, or a params export")
    parser.add_argument("--tasks", required=True, help="comma-separated task names (lm-eval's, or --include_path's)")
    parser.add_argument("--include_path", help="a folder of task YAML files to add to lm-eval's own")
    parser.add_argument("--limit", type=float, help="at most this many documents per task (a fraction below 1)")
    parser.add_argument("--num_fewshot", type=int, help="examples in each prompt (default: the task's)")
    parser.add_argument("--batch_size", type=int, default=16, help="rows per forward pass (default 16)")
    parser.add_argument("--output_path", help="a folder for the results file (and --log_samples' samples)")
    parser.add_argument("--log_samples", action="store_true", help="also write every request and response")
    parser.add_argument("--apply_chat_template", action="store_true", help="render prompts with the run's chat template")
    parser.add_argument("--model_args", default="",
                        help="more model arguments: max_length, max_gen_toks, add_bos_token, precision, mesh.*")
    parser.add_argument("--seed", type=int, default=0, help="for sampled generation and few-shot draws (default 0)")
    return parser


def run(args: argparse.Namespace) -> dict:
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import simple_parse_args_string

    import maxtext_rocm.eval.model  # noqa: F401  registers "maxtext_rocm" with lm-eval
    from maxtext_rocm.api import run_config
    from maxtext_rocm.eval import placement

    # A wrong path, or a mesh these devices cannot hold, is one sentence before lm-eval indexes its tasks.
    cfg = run_config(args.run)
    mesh = {**placement.mesh_overrides(simple_parse_args_string(args.model_args)),
            **placement.overrides_from_flags(args.config)}
    if mesh:
        placement.mesh_config(cfg, mesh)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = task_manager(args.include_path, tasks)
    model_args = {**simple_parse_args_string(args.model_args), **mesh, "run": args.run, "seed": args.seed}
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = lm_eval.simple_evaluate(
        model="maxtext_rocm", model_args=model_args, tasks=tasks, num_fewshot=args.num_fewshot,
        batch_size=args.batch_size, limit=args.limit, log_samples=args.log_samples, task_manager=manager,
        evaluation_tracker=tracker, apply_chat_template=args.apply_chat_template, random_seed=args.seed,
        numpy_random_seed=args.seed, fewshot_random_seed=args.seed)
    if tracker is not None:
        # Named after the run (lm-eval names a folder after `pretrained=`, which a run does not have).
        from lm_eval.utils import sanitize_model_name

        name = Path(args.run).absolute().name
        tracker.general_config_tracker.model_name = name
        tracker.general_config_tracker.model_name_sanitized = sanitize_model_name(name)
        samples = results.pop("samples") if args.log_samples else None
        tracker.save_results_aggregated(results=results, samples=samples)
        for task_name in (samples or {}):
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    return results


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    args.config = rest  # --config.mesh.* flags: the mesh to evaluate on (eval/placement.py)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print(f"error: {not_installed('evaluation')}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    try:
        results = run(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if args.output_path:
        print(f"results in {args.output_path}", file=sys.stderr)
    return 0
