"""The package's version, in a module that imports nothing: ``lightning-flce --version`` reads it without
loading torch. The one place of the version: ``pyproject.toml`` reads it (``[tool.hatch.version]``)."""

__version__ = "0.1.0"
