"""The package's version, in a module that imports nothing: ``lightning-flce --version`` reads it without
loading torch. Keep it equal to ``version`` in ``pyproject.toml`` (tests/test_cli_errors.py checks)."""

__version__ = "0.1.0"
