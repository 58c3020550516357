"""Errors a user can cause, each carrying the process exit code the CLI returns.

`ValueError`-style user errors become one line on stderr; internal invariants stay `assert`s.
"""

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3


class PlanError(Exception):
    """An error meant for the user: one line, no traceback (unless --debug)."""

    exit_code = EXIT_BAD_INPUT


class BadInput(PlanError):
    """The user's input (file, flag, model) is wrong: exit code 2."""

    exit_code = EXIT_BAD_INPUT


class Infeasible(PlanError):
    """Nothing fits under the constraints: exit code 3."""

    exit_code = EXIT_INFEASIBLE
