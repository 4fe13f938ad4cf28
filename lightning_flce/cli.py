"""Command line: ``lightning-flce fit --config configs/default.yaml`` (or ``python -m lightning_flce ...``)."""

from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

# imported so that their classes are listed in --help and found by short name (--model TinyGPT)
import lightning_flce.data  # noqa: F401
import lightning_flce.models  # noqa: F401


class FLCELightningCLI(LightningCLI):
    """``LightningCLI`` whose model and data are chosen by ``class_path``, with the vocabulary size linked.

    The data module's ``vocab_size`` attribute (the real tokenizer size, known only once the data module
    exists) is passed to the model's ``vocab_size`` init argument, so the two never disagree: a
    ``model.init_args.vocab_size`` given on the command line or in YAML is replaced by it (set
    ``data.init_args.vocab_size`` instead). A model without a ``vocab_size`` argument is left alone. The
    subcommands are ``fit``, ``validate`` and ``test``.

    Example (shell)::

        lightning-flce fit --config configs/default.yaml
        lightning-flce fit --config configs/default.yaml --trainer.max_steps 100 --print_config
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
        kwargs.setdefault("parser_kwargs", {"prog": "lightning-flce"})
        super().__init__(pl.LightningModule, pl.LightningDataModule, args=args, run=run, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # The data modules here have no predict split.
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")


def main(args: Optional[Union[list[str], dict[str, Any]]] = None) -> None:
    """Entry point of the ``lightning-flce`` console script; ``args`` defaults to ``sys.argv[1:]``."""
    FLCELightningCLI(args=args)


if __name__ == "__main__":
    main()
