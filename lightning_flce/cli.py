"""Command line: ``lightning-flce fit --config default`` (or ``python -m lightning_flce ...``).

``--config`` takes a file or the name of a config shipped in the package (``lightning_flce/configs/``);
``lightning-flce configs`` lists those names and ``lightning-flce --version`` prints the version, both without
importing torch or Lightning. Everything else goes to :class:`FLCELightningCLI` (``cli_lightning.py``), whose
errors are short messages (``cli_errors.py``); ``LIGHTNING_FLCE_DEBUG=1`` in the environment gives the full
reports and tracebacks instead.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_flce._version import __version__
from lightning_flce.cli_errors import did_you_mean

if TYPE_CHECKING:
    from lightning_flce.cli_lightning import FLCELightningCLI

PROG = "lightning-flce"
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_CONFIG_FLAGS = ("-c", "--config")
_VERSION_FLAGS = ("-V", "--version")
# A bare name: no directory part and nothing jsonargparse would read as inline YAML/JSON.
_BARE_NAME = re.compile(r"[\w.-]+")


def bundled_configs() -> dict[str, Path]:
    """Names of the configs shipped in the package (``default``, ``hf_llama``, ...) and their files."""
    return {path.stem: path for path in sorted(CONFIG_DIR.glob("*.yaml"))}


def resolve_config(value: str) -> str:
    """The file a ``--config`` value names: an existing path, inline YAML/JSON and anything with a directory
    part are returned unchanged; a bare name (``default`` or ``default.yaml``) that is no file in the
    working directory is the bundled config of that name. An unknown bare name raises ``SystemExit`` with
    the closest bundled names and the list of all, rather than jsonargparse's parse error of the name as
    inline YAML."""
    if Path(value).exists() or not _BARE_NAME.fullmatch(value):
        return value
    name = value[: -len(".yaml")] if value.endswith(".yaml") else value
    configs = bundled_configs()
    if name not in configs:
        raise SystemExit(
            f"{PROG}: error: --config {value!r} is neither a file nor a bundled config"
            + did_you_mean(name, configs)
            + "\n  bundled: "
            + ", ".join(configs)
        )
    return str(configs[name])


def resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with every ``--config``/``-c`` value passed through :func:`resolve_config`."""
    resolved = list(args)
    for i, arg in enumerate(resolved):
        if arg in _CONFIG_FLAGS and i + 1 < len(resolved):
            resolved[i + 1] = resolve_config(resolved[i + 1])
        elif arg.startswith("--config="):
            resolved[i] = "--config=" + resolve_config(arg[len("--config=") :])
    return resolved


def describe_bundled_configs() -> str:
    """One line per bundled config: its name and its title (the first line of its header comment)."""
    lines = []
    for name, path in bundled_configs().items():
        first = next((line for line in path.read_text().splitlines() if line.startswith("#")), "#")
        lines.append(f"{name:<14} {first.lstrip('# ').rstrip()}")
    lines.append(
        f"\n(files in {CONFIG_DIR}; `lightning-flce fit --config NAME --print_config > my.yaml` gives an"
        " editable copy, then `--config my.yaml`)"
    )
    return "\n".join(lines)


def __getattr__(name: str) -> Any:
    # The LightningCLI subclass loads Lightning: imported on first use, so `configs` and `--version` stay fast.
    if name == "FLCELightningCLI":
        return importlib.import_module("lightning_flce.cli_lightning").FLCELightningCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(args: Optional[Union[list[str], dict[str, Any]]] = None) -> None:
    """Entry point of the ``lightning-flce`` console script; ``args`` defaults to ``sys.argv[1:]``.
    ``lightning-flce configs`` prints the bundled configs and ``--version`` (``-V``) the version, both without
    importing torch or Lightning; everything else goes to :class:`FLCELightningCLI`."""
    command = sys.argv[1:] if args is None else args
    if isinstance(command, list) and len(command) == 1 and command[0] in _VERSION_FLAGS:
        print(f"{PROG} {__version__}")
        return
    if isinstance(command, list) and command[:1] == ["configs"]:
        print(describe_bundled_configs())
        return
    from lightning_flce.callbacks.checkpoint_identity import CheckpointModelMismatch
    from lightning_flce.cli_errors import debug_requested
    from lightning_flce.cli_lightning import FLCELightningCLI

    try:
        FLCELightningCLI(args=args)
    except CheckpointModelMismatch as error:
        # a resume into another model: the message names both models and the fix; the traceback adds nothing
        if debug_requested():
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


__all__ = [
    "CONFIG_DIR",
    "FLCELightningCLI",
    "bundled_configs",
    "describe_bundled_configs",
    "main",
    "resolve_config",
    "resolve_config_args",
]


if __name__ == "__main__":
    main()
