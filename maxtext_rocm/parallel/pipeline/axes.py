"""The pipeline's mesh axis and the logical axes of what its loop carries between stages."""

from maxtext_rocm.models.llama import BLOCK_OUTPUT_AXES

STAGE_AXIS = "stage"  # the mesh axis; "activation_stage" is its logical name (sharding.py)
STATE_AXES = ("activation_stage",) + BLOCK_OUTPUT_AXES  # each stage's activations [S, mb, seq, d]
TOKEN_AXES = ("activation_stage", "activation_batch", "activation_length")  # positions, segments
