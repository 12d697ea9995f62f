"""maxtext_rocm: a readable JAX/Flax trainer for Llama and Mixtral, first on ROCm.

The names a notebook needs, re-exported:

    import maxtext_rocm as mr
    cfg = mr.load_config("configs/tiny_llama.py", overrides={"train.steps": 50})
    mr.Trainer(cfg).run()
"""

from maxtext_rocm.config import ConfigError, UserError
from maxtext_rocm.config import load as load_config
from maxtext_rocm.models import build_model, count_active_params, count_params, forward


def __getattr__(name):
    # Imported on first use, so `python -m maxtext_rocm.train` does not import train.py twice.
    if name == "Trainer":
        from maxtext_rocm.train import Trainer

        return Trainer
    raise AttributeError(f"module 'maxtext_rocm' has no attribute {name!r}")

__all__ = ["ConfigError", "Trainer", "UserError", "build_model", "count_active_params", "count_params",
           "forward", "load_config"]
