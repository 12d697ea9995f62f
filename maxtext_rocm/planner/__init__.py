"""The AOT planner behind `python -m maxtext_rocm.compile`: the fit check on faked GPU nodes,
activation estimates, communication and FLOPs read from XLA's programs."""
