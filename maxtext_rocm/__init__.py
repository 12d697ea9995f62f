"""maxtext_rocm: a readable JAX/Flax trainer for Llama, Mixtral, Mistral and Qwen, first on ROCm.

The names a notebook needs, re-exported:

    import maxtext_rocm as mr
    cfg = mr.load_config("configs/tiny_llama.py", overrides={"train.steps": 50})
    mr.Trainer(cfg).run()
    params = mr.load_params(cfg.output_dir)     # or mr.init_params(cfg, seed=0)
    mr.generate(cfg, params, [prompt_ids], max_new_tokens=32, temperature=0.8, top_k=40)
    mr.chat(cfg, params, [{"role": "user", "content": "Hi"}])   # the reply, with the chat template
"""

# `python -m maxtext_rocm.train`: a SIGTERM/SIGINT during the imports below (seconds of jax) and
# the trainer's start-up exits with one line instead of silently or with a traceback.
from maxtext_rocm.runtime import startup_signals as _startup_signals

if _startup_signals.started_as_train_cli():
    _startup_signals.arm()

from maxtext_rocm.config import ConfigError, UserError  # noqa: E402
from maxtext_rocm.config import load as load_config  # noqa: E402
from maxtext_rocm.models import build_model  # noqa: E402
from maxtext_rocm.api import (count_active_params, count_params, forward, init_params, load_params, loss,  # noqa: E402
                              run_config)
from maxtext_rocm.generate import chat, generate  # noqa: E402

# `python -m maxtext_rocm.generate` runs a module this package has already imported (for the
# function of the same name); runpy's warning about that says nothing a user can act on.
import warnings as _warnings  # noqa: E402

_warnings.filterwarnings("ignore", message="'maxtext_rocm.generate' found in sys.modules", category=RuntimeWarning)


def __getattr__(name):
    # Imported on first use: `import maxtext_rocm` stays light for the commands that train nothing.
    if name == "Trainer":
        from maxtext_rocm.trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'maxtext_rocm' has no attribute {name!r}")

__all__ = ["ConfigError", "Trainer", "UserError", "build_model", "chat", "count_active_params", "count_params",
           "forward", "generate", "init_params", "load_config", "load_params", "loss", "run_config"]
