"""The process's life: distributed start-up, peers, the hang watchdog, signals and preemption,
the run lock. Nothing here imports jax at module level where start-up must stay light."""
