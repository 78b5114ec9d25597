"""Exceptions of trakcli.

Every error a user can cause is a :class:`TrakError` whose message says what
happened, the offending value, and how to fix it. The CLI prints the message
as one red line on stderr and exits with :attr:`TrakError.exit_code`
(``TRAK_DEBUG=1`` shows the traceback). Library code never calls ``sys.exit``.
"""

from __future__ import annotations


class TrakError(Exception):
    """Base class of every user-facing trakcli error.

    Attributes:
        exit_code: process exit status the CLI uses for this error (1).
    """

    exit_code: int = 1


class ConfigError(TrakError):
    """The YAML config or a ``key=value`` override is invalid.

    Attributes:
        problems: one human-readable line per problem, each starting with the
            dotted config key it concerns.
    """

    def __init__(self, problems: list[str] | str, source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        where = f" in {source}" if source else ""
        n = len(self.problems)
        if n == 1:
            super().__init__(f"config{where}: {self.problems[0]}")
        else:
            head = f"{n} problems with the config{where}:"
            super().__init__(head + "\n" + "\n".join(f"  - {p}" for p in self.problems))


class UsageError(TrakError):
    """A command-line flag has a bad value (exit code 2, like a click usage error).

    Raised by the CLI (``trakcli.cli``) about its own flags. Library code
    raises :class:`ArgumentError` instead.
    """

    exit_code = 2


class ArgumentError(UsageError):
    """A library function was given an argument it cannot use: a path it cannot write, a count below 1, no rows.

    Library code (plots, retraining) raises it; the message names the argument
    as the caller named it (e.g. ``check_plot_path(path, flag="--plot")``). A
    command that passes a flag's value straight through reports it as that bad
    flag: exit code 2, hence a :class:`UsageError` subclass (which also keeps
    ``except UsageError`` handlers working).
    """


class DataError(TrakError):
    """The training or target data cannot be loaded or does not fit the model."""


class ModelError(TrakError):
    """The model cannot be built, or a checkpoint does not fit it."""


class CheckpointError(ModelError):
    """A checkpoint file is missing, unreadable or does not match the model."""


class ProjectorError(TrakError):
    """A projector was asked for with invalid options, or is not available here."""


class StoreError(TrakError):
    """The Zarr store cannot be written, or holds data made with other settings."""


class StoreMismatchError(StoreError):
    """The store was made with a different config; ``--overwrite`` starts over."""


class GradientError(TrakError):
    """Per-example gradients could not be computed or are not finite."""


class OptimizerError(TrakError):
    """A projected optimizer was built or loaded with invalid settings or state."""
