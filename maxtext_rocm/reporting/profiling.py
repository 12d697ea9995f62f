"""`log.profile_steps = (start, end)`: a jax.profiler trace of steps start..end-1 (0-based).

The trace lands in `output_dir/profile/plugins/profile/<time>/`, where TensorBoard's profile
plugin finds it (`tensorboard --logdir OUTPUT_DIR/profile`, see README). Process 0 traces.
"""

from __future__ import annotations

import os

import jax


class Profiler:
    def __init__(self, profile_steps, output_dir: str, enabled: bool = True):
        self.start, self.end = (int(s) for s in profile_steps)
        self.directory = os.path.join(output_dir, "profile")
        self.enabled = enabled and self.end > self.start
        self.active = False

    def before_step(self, step: int) -> None:
        """Called with the number of steps taken so far, before the next one."""
        if self.enabled and not self.active and self.start <= step < self.end:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after_step(self, step: int, outputs=None) -> None:
        """Called with the number of steps taken so far (the one just taken included)."""
        if self.active and step >= self.end:
            self.stop(outputs)

    def stop(self, outputs=None) -> None:
        """Ends the trace (waiting for `outputs`, so the traced steps are complete)."""
        if self.active:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.active = False
