"""lm-eval's own command line with the "maxtext_rocm" model registered:

    python -m maxtext_rocm.eval.lm_eval_cli --model maxtext_rocm --model_args run=RUN --tasks T1,T2 [lm_eval's flags]

lm-eval 0.4 finds a model only in its registry, which a module fills when it is imported; the
`lm_eval` script imports its own models and nothing else (no entry points, and --include_path
reads task YAML, not Python). This imports ours, then hands the arguments to lm-eval unchanged.
A mesh to evaluate on goes in the model arguments under its config keys (eval/placement.py):
`--model_args run=RUN,mesh.ici.fsdp=4,mesh.ici.tensor=2` (lm-eval splits them at commas).
"""

import sys

from maxtext_rocm.eval.tasks import not_installed


def main() -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:  # the optional extra: one sentence, as `python -m maxtext_rocm.eval` says it
        print(f"error: {not_installed('evaluation')}", file=sys.stderr)
        return 2
    import maxtext_rocm.eval.model  # noqa: F401  registers "maxtext_rocm"
    from maxtext_rocm.errors import UserError

    try:
        return cli_evaluate() or 0
    except UserError as error:  # a model argument (run=, mesh.*=) that cannot be: one sentence
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
