"""The old entry point of the ``engine`` command, kept for scripts that name it; see engine/cli/."""

from engine.cli.main import main  # noqa: F401
