"""The ``LightningCLI`` of the ``lightning-flce`` command: :class:`FLCELightningCLI`.

Imported by :func:`lightning_flce.cli.main` only for the subcommands that need Lightning (``fit``,
``validate``, ``test``, ``--help``); ``lightning-flce configs`` and ``--version`` never load this module.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from typing import Any, NoReturn, Optional

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_helpers import is_overridden

# imported so that their classes are listed in --help and found by short name (--model TinyGPT)
import lightning_flce.data  # noqa: F401
import lightning_flce.models  # noqa: F401
from lightning_flce._version import __version__
from lightning_flce.cli import _CONFIG_FLAGS, PROG, bundled_configs, resolve_config_args
from lightning_flce.cli_errors import (
    DEBUG_ENV,
    debug_requested,
    describe_instantiation_error,
    describe_parse_error,
)

log = logging.getLogger(__name__)

_CONFIG_HELP = (
    "A YAML or JSON config file, or the name of a config shipped with the package: "
    + ", ".join(bundled_configs())
    + " (`lightning-flce configs` describes them). Repeatable: later ones override earlier ones."
)


def _fail(message: str) -> NoReturn:
    """Print ``message`` to stderr and exit with status 2, as argparse does for a usage error."""
    sys.stderr.write(message.rstrip() + "\n")
    sys.exit(2)


class FLCEArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose parse errors are a few lines without the usage dump: the key, the value,
    what is accepted and close matches (:func:`lightning_flce.cli_errors.describe_parse_error`).
    ``LIGHTNING_FLCE_DEBUG=1`` keeps jsonargparse's full report."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        # Nested parsers jsonargparse builds for a class (exit_on_error=False) raise, and their caller reports.
        if not self.exit_on_error or debug_requested():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        _fail(
            f"{prog}: error: {describe_parse_error(message, parser, prog)}\n"
            f"  ({DEBUG_ENV}=1 shows jsonargparse's full report)"
        )


class FLCELightningCLI(LightningCLI):
    """``LightningCLI`` whose model and data are chosen by ``class_path``, with the vocabulary size linked.

    The data module's ``vocab_size`` attribute (the real tokenizer size, known only once the data module
    exists) is passed to the model's ``vocab_size`` init argument, so the two never disagree: a
    ``model.init_args.vocab_size`` given on the command line or in YAML is replaced by it, with a warning when the
    two differ (set ``data.init_args.vocab_size`` instead). A model without a ``vocab_size`` argument is left
    alone. The subcommands are ``fit``, ``validate``, ``test`` and ``predict`` (a teacher's top-k cache:
    ``--config teacher_cache``).

    A mistyped key or a bad value exits with status 2 and a short message that names the key, the value and
    what is accepted ("did you mean ..."); so does an exception raised while the classes are built (a model's
    ``ValueError``, a missing optional dependency with its install command). ``LIGHTNING_FLCE_DEBUG=1`` in the
    environment gives jsonargparse's full report and the traceback instead.

    Example (shell)::

        lightning-flce configs                         # the bundled configs, one line each
        lightning-flce --version
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
        kwargs.setdefault("parser_class", FLCEArgumentParser)
        # A second run in the same log directory would otherwise abort because config.yaml exists.
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # Same name in the help whether started as the console script or as ``python -m lightning_flce``.
        kwargs.setdefault(
            "parser_kwargs",
            {
                "prog": PROG,
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

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        # main() answers --version before Lightning loads; here it is listed in --help.
        self.parser.add_argument("-V", "--version", action="version", version=f"{PROG} {__version__}")

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # Bundled config names become their paths; the rest is LightningCLI's parsing.
        if args is None:
            self.config = parser.parse_args(resolve_config_args(sys.argv[1:]))
            return
        super().parse_arguments(parser, resolve_config_args(args) if isinstance(args, list) else args)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")

    def instantiate_classes(self) -> None:
        # An exception of a class's __init__ becomes a short message (LIGHTNING_FLCE_DEBUG=1: the traceback).
        config = self.config.get(str(self.config.get("subcommand")), self.config)
        given_vocab_size = _user_vocab_size(config)
        try:
            super().instantiate_classes()
        except Exception as err:
            if debug_requested():
                raise
            groups = {
                group: str(config.get(f"{group}.class_path"))
                for group in ("model", "data")
                if config.get(f"{group}.class_path")
            }
            prog = f"{PROG} {self.config.get('subcommand') or ''}".rstrip()
            _fail(f"{prog}: error: {describe_instantiation_error(err, groups)}")
        linked = getattr(self.datamodule, "vocab_size", None)
        if given_vocab_size is not None and isinstance(linked, int) and linked != given_vocab_size:
            _warn_once(
                f"model.init_args.vocab_size={given_vocab_size} is replaced by the data module's vocab_size="
                f"{linked} (the tokenizer's size); set data.init_args.vocab_size instead"
            )

    def before_predict(self) -> None:
        # The training models' predict_step gives each batch's [B, T, V] logits (for trainer.predict from Python):
        # over a corpus that is no file to keep. Refused before any batch, with the config whose predictions are one.
        from lightning_flce.mixin import FLCEMixin

        if isinstance(self.model, FLCEMixin) or not is_overridden(
            "predict_step", self.model, pl.LightningModule
        ):
            _fail(
                f"{PROG} predict: error: {type(self.model).__name__}'s predictions are its logits, [tokens, vocab] a"
                f" batch; `{PROG} predict --config teacher_cache` writes a teacher's top-k cache"
                " (lightning_flce.models.TeacherTopKModule)"
            )


def _user_vocab_size(config: Any) -> Optional[int]:
    """The model's ``vocab_size`` in the parsed config when it differs from the class's default, i.e. when a
    user set it; ``None`` otherwise (or when the model has no such argument)."""
    value = config.get("model.init_args.vocab_size") if config.get("model.init_args") is not None else None
    class_path = config.get("model.class_path")
    if value is None or not class_path:
        return None
    module_name, _, class_name = str(class_path).rpartition(".")
    try:
        model_class = getattr(importlib.import_module(module_name), class_name)
        default = inspect.signature(model_class.__init__).parameters["vocab_size"].default
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return None
    return None if value == default else int(value)


@rank_zero_only
def _warn_once(message: str) -> None:
    # One line on stderr (Python's fallback handler prints a bare WARNING message when logging is unset).
    log.warning("lightning-flce: warning: %s", message)
