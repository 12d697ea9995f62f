"""Checkpoints: the Checkpointer's orbax saves and verified restores (checkpointer.py), checksums that
do not depend on the mesh (checksums.py), verified readers of parameters and exports (reading.py),
params exports (params.py), a LoRA run's base and adapters for every reader (lora_run.py),
orbax's failures in one sentence (errors.py), and the command line (cli.py: export, verify).

A checkpoint is `output_dir/checkpoints/<step>/` with three items:
- `state`: the TrainState (step, params, optimizer state, non-finite counters), sharded arrays;
- `data`:  every data-loading process's position and the data files' fingerprint, so the batch
           after a resume is the one that would have come;
- `meta`:  the step, the model config, and checksums of every array and of the data position.
"""

from maxtext_rocm.checkpoint.checkpointer import (  # noqa: F401
    DATA, META, STATE, Checkpointer, NonFiniteState, Resume, SaveFailed, committed_steps)
from maxtext_rocm.checkpoint.cli import main  # noqa: F401
from maxtext_rocm.checkpoint.params import (  # noqa: F401
    export_params, restore_params, restore_params_to_host, run_config, verify_params)
from maxtext_rocm.errors import CheckpointError  # noqa: F401  (what every reader raises)
