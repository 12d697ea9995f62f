"""The errors a user's mistake raises. At the bottom of the import graph: config loading, its
checks, the data pipeline and checkpoints all raise these, and none of them imports the others
to do so. `maxtext_rocm.config` re-exports them."""


class UserError(ValueError):
    """A mistake in what the user asked for; the command line prints it and exits with status 2."""


class ConfigError(UserError):
    """A config key is unknown, mistyped or inconsistent with the others."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, unreadable, or of another model's shapes."""
