"""Command line: ``lightning-flce fit --config default`` (or ``python -m lightning_flce ...``).

``--config`` takes a file or the name of a config shipped in the package (``lightning_flce/configs/``);
``lightning-flce configs`` lists those names.
"""

import re
import sys
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

# imported so that their classes are listed in --help and found by short name (--model TinyGPT)
import lightning_flce.data  # noqa: F401
import lightning_flce.models  # noqa: F401

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_CONFIG_FLAGS = ("-c", "--config")
# A bare name: no directory part and nothing jsonargparse would read as inline YAML/JSON.
_BARE_NAME = re.compile(r"[\w.-]+")


def bundled_configs() -> dict[str, Path]:
    """Names of the configs shipped in the package (``default``, ``hf_llama``, ...) and their files."""
    return {path.stem: path for path in sorted(CONFIG_DIR.glob("*.yaml"))}


def resolve_config(value: str) -> str:
    """The file a ``--config`` value names: an existing path, inline YAML/JSON and anything with a directory
    part are returned unchanged; a bare name (``default`` or ``default.yaml``) that is no file in the
    working directory is the bundled config of that name. An unknown bare name raises ``SystemExit`` with
    the list of bundled names, rather than jsonargparse's parse error of the name as inline YAML."""
    if Path(value).exists() or not _BARE_NAME.fullmatch(value):
        return value
    name = value[: -len(".yaml")] if value.endswith(".yaml") else value
    configs = bundled_configs()
    if name not in configs:
        raise SystemExit(
            f"lightning-flce: error: --config {value!r} is neither a file nor a bundled config; bundled: "
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


_CONFIG_HELP = (
    "A YAML or JSON config file, or the name of a config shipped with the package: "
    + ", ".join(bundled_configs())
    + " (`lightning-flce configs` describes them). Repeatable: later ones override earlier ones."
)


class FLCELightningCLI(LightningCLI):
    """``LightningCLI`` whose model and data are chosen by ``class_path``, with the vocabulary size linked.

    The data module's ``vocab_size`` attribute (the real tokenizer size, known only once the data module
    exists) is passed to the model's ``vocab_size`` init argument, so the two never disagree: a
    ``model.init_args.vocab_size`` given on the command line or in YAML is replaced by it (set
    ``data.init_args.vocab_size`` instead). A model without a ``vocab_size`` argument is left alone. The
    subcommands are ``fit``, ``validate`` and ``test``.

    Example (shell)::

        lightning-flce configs                         # the bundled configs, one line each
        lightning-flce fit --config default            # a bundled config by name
        lightning-flce fit --config default --trainer.max_steps 100 --print_config
        lightning-flce fit --config my.yaml            # or a file
        lightning-flce fit --model.help TinyGPT        # the model's options, FLCEMixin's flce_* included

    Example (YAML passed with ``--config``)::

        model:
          class_path: lightning_flce.models.TinyGPT
          init_args:
            d_model: 128
        data:
          class_path: lightning_flce.data.PythonStdlibDataModule
          init_args:
            vocab_size: 8192
        trainer:
          max_steps: 500

    """

    def __init__(self, args: ArgsType = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        # A second run in the same log directory would otherwise abort because config.yaml exists.
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # Same name in the help whether started as the console script or as ``python -m lightning_flce``.
        kwargs.setdefault(
            "parser_kwargs",
            {
                "prog": "lightning-flce",
                "description": "Train, validate or test a model whose LM loss is the fused linear cross-entropy."
                " `lightning-flce configs` lists the configs shipped with the package; `lightning-flce fit"
                " --config default` runs the main job.",
            },
        )
        super().__init__(pl.LightningModule, pl.LightningDataModule, args=args, run=run, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # LightningCLI's parser, with a --config help that names the bundled configs.
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={pl.__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument(*_CONFIG_FLAGS, action=ActionConfigFile, help=_CONFIG_HELP)
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # Bundled config names become their paths; the rest is LightningCLI's parsing.
        if args is None:
            self.config = parser.parse_args(resolve_config_args(sys.argv[1:]))
            return
        super().parse_arguments(parser, resolve_config_args(args) if isinstance(args, list) else args)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # The data modules here have no predict split.
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")


def main(args: Optional[Union[list[str], dict[str, Any]]] = None) -> None:
    """Entry point of the ``lightning-flce`` console script; ``args`` defaults to ``sys.argv[1:]``.
    ``lightning-flce configs`` prints the bundled configs; everything else goes to :class:`FLCELightningCLI`."""
    command = sys.argv[1:] if args is None else args
    if isinstance(command, list) and command[:1] == ["configs"]:
        print(describe_bundled_configs())
        return
    FLCELightningCLI(args=args)


if __name__ == "__main__":
    main()
