"""The Trainer's parts: launch (state, step and their compilation), the pure train step, the
optimizer, compilation options and cache, divergence handling."""
