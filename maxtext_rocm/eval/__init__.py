"""Evaluation with EleutherAI's lm-evaluation-harness (`pip install -e '.[eval]'`) on the run's own
model: `python -m maxtext_rocm.eval RUN --tasks ...` (cli.py), lm-eval's own command line with
this model registered (lm_eval_cli.py), and from Python `import maxtext_rocm.eval.model`, then
`lm_eval.simple_evaluate(model="maxtext_rocm", model_args={"run": RUN}, ...)` (model.py). A saved
run is evaluated on the mesh it trained on, or one given (placement.py); during training, on the
Trainer's (in_training.py).

Nothing here imports lm_eval until it is used, so the command can say what to install.
"""
