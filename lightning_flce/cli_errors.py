"""Short error messages of the ``lightning-flce`` command.

jsonargparse reports a mistyped key or a bad value after a usage dump of some 45 lines, nested in Union errors
with a ``Namespace(...)`` dump; an exception raised by a model's ``__init__`` comes as a traceback of some 80
lines. The functions here turn those into a few lines that name the key, the value and what is accepted, with
"did you mean" suggestions, and a missing optional dependency into its install command. ``LIGHTNING_FLCE_DEBUG=1``
in the environment keeps jsonargparse's full report and the tracebacks.

Only the standard library is imported at module level: ``lightning-flce configs`` and ``--version`` use
:func:`did_you_mean` without loading torch or Lightning.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
from collections.abc import Iterable
from typing import Any, Optional

DEBUG_ENV = "LIGHTNING_FLCE_DEBUG"

# The extra of ``pyproject.toml`` that installs an optional dependency, by the module a missing import names.
_EXTRAS = {"transformers": "hf", "peft": "peft", "triton": "triton"}
_INSTALL = {
    "litgpt": 'pip install --no-deps litgpt && pip install "lightning-flce[litgpt]"',
}

_NOT_ACCEPTED = re.compile(
    r"Problem with given class_path '(?P<cls>[\w.]+)':\s*Option '(?P<key>[\w.]+)' is not accepted"
)
_GROUP_NOT_ACCEPTED = re.compile(r"Group '(?P<group>[\w.]+)' does not accept option '(?P<key>[\w.]+)'")
_UNRECOGNIZED = re.compile(r"[Uu]nrecognized arguments: (?P<args>.*)")
_PARSER_KEY = re.compile(r'Parser key "(?P<key>[\w.]+)"')
_CLASS_PATH = re.compile(r"Problem with given class_path '(?P<cls>[\w.]+)'")
_NO_CLASS = re.compile(
    r"Expected a dot import path string: (?P<name>\S+)"
    r"|module '(?P<module>[\w.]+)' has no attribute '(?P<attr>\w+)'"
)
# Where the classes of a group are found by short name (``--model TinyGPT``).
_CLASS_MODULES = {"model": "lightning_flce.models", "data": "lightning_flce.data"}
_GIVEN_VALUE = re.compile(r"^\s*Given value: (?P<value>.*)$", re.MULTILINE)
_LITERAL = re.compile(r"^typing(?:_extensions)?\.Literal\[(?P<choices>.*)\]$")
_TYPE_NAME = re.compile(r"<class '(?:builtins\.)?(?P<name>[\w.]+)'>")
# Lines of a jsonargparse report that say nothing to a user: the Union plumbing and the value dumps.
_NOISE = re.compile(r"^\s*(Subtypes:|Given value type:|Given value:|- Expected a <class 'NoneType'>|Errors:)")


def debug_requested() -> bool:
    """Whether ``LIGHTNING_FLCE_DEBUG`` asks for jsonargparse's full reports and the tracebacks."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def did_you_mean(name: str, candidates: Iterable[str], quote: bool = False) -> str:
    """``"; did you mean X?"`` (or ``"X or Y"``) with the candidates closest to ``name``, else ``""``: difflib's
    matches above 0.6 that score within 0.1 of the best one."""
    scored = sorted(
        ((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in dict.fromkeys(candidates) if c != name),
        reverse=True,
    )
    matches = [c for score, c in scored[:3] if score >= 0.6 and score >= scored[0][0] - 0.1]
    if not matches:
        return ""
    shown = [repr(m) if quote else m for m in matches]
    return "; did you mean " + " or ".join(shown) + "?"


def renamed_hint(key: str) -> str:
    """``"; it was renamed to flce_lse_square_scale (...)"`` for an option name of
    :data:`lightning_flce.deprecation.RENAMED` (with or without the mixin's ``flce_`` prefix), else ``""``. Python
    callers still get the old names through a warning; a config must use the new one (the CLI checks the keys
    against the signatures, which list only the new names)."""
    from lightning_flce.deprecation import RENAMED

    prefix = "flce_" if key.startswith("flce_") else ""
    renamed = RENAMED.get(key[len(prefix) :])
    if renamed is None:
        return ""
    hint = renamed.hint.format(old=key, new=prefix + renamed.new)
    return f"; it was renamed to {prefix + renamed.new}{hint}"


def class_options(class_path: str) -> list[str]:
    """The init arguments jsonargparse accepts for ``class_path`` under ``init_args`` (for a model with
    ``FLCEMixin`` that includes the mixin's ``flce_*`` options, which jsonargparse follows through ``**kwargs``);
    ``[]`` when the class cannot be imported."""
    from jsonargparse import ArgumentParser

    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
    except Exception:  # suggestions are a nicety; the error message is printed without them
        return []
    return _option_names(parser)


def _option_names(parser: Any, prefix: str = "") -> list[str]:
    names = []
    for action in getattr(parser, "_actions", []):
        dest = getattr(action, "dest", "")
        if (
            not dest.startswith(prefix)
            or dest.endswith(".help")
            or dest in ("help", "config", "print_config")
        ):
            continue
        name = dest[len(prefix) :].split(".")[0]
        if name and name != "__default_config__":
            names.append(name)
    return list(dict.fromkeys(names))


def _parsers(parser: Any) -> list[Any]:
    """``parser`` and its subcommands' parsers (a YAML key's error can be reported by the top-level parser)."""
    if parser is None:
        return []
    found = [parser]
    for action in getattr(parser, "_actions", []):
        if isinstance(getattr(action, "choices", None), dict):
            found += [p for p in action.choices.values() if hasattr(p, "_actions")]
    return found


def _describe_type(type_text: str) -> tuple[str, list[str]]:
    """``("one of 'a', 'b'", ["a", "b"])`` for a Literal, else a readable type name and no choices."""
    literal = _LITERAL.match(type_text.strip())
    if literal:
        choices = re.findall(r"'([^']*)'|\"([^\"]*)\"|([^,\s][^,]*)", literal.group("choices"))
        values = [next(part for part in choice if part) for choice in choices]
        return "one of " + ", ".join(repr(v) for v in values), values
    name = _TYPE_NAME.fullmatch(type_text.strip())
    return (name.group("name") if name else type_text.strip()), []


def _group_of(message: str) -> str:
    key = _PARSER_KEY.search(message)
    return key.group("key") if key else ""


def describe_parse_error(message: str, subcommand_parser: Any = None, prog: str = "lightning-flce") -> str:
    """A few lines for jsonargparse's parse error ``message``: the key, the value, what is accepted, close
    matches. ``subcommand_parser`` (the parser of ``fit``, ``validate``, ...) gives the accepted keys of the
    groups that are not classes (``trainer``); without it those get no suggestion."""
    not_accepted = _NOT_ACCEPTED.search(message)
    if not_accepted:
        cls, key = not_accepted.group("cls"), not_accepted.group("key")
        group = _group_of(message)
        where = f"{group}.init_args.{key}" if group else key
        return (
            f"{where}: {cls.rpartition('.')[2]} has no option {key!r}"
            + (renamed_hint(key) or did_you_mean(key, class_options(cls)))
            + f"\n  (`{prog} --{group or 'model'}.help {cls}` lists its options)"
        )
    group_not_accepted = _GROUP_NOT_ACCEPTED.search(message)
    if group_not_accepted:
        group, key = group_not_accepted.group("group"), group_not_accepted.group("key")
        accepted = [
            name for parser in _parsers(subcommand_parser) for name in _option_names(parser, group + ".")
        ]
        return f"{group}.{key}: {group} has no option {key!r}" + did_you_mean(key, accepted)
    unrecognized = _UNRECOGNIZED.search(message)
    if unrecognized:
        args = unrecognized.group("args").strip()
        flags = [a for a in args.split() if a.startswith("--")]
        accepted = [
            option
            for action in getattr(subcommand_parser, "_actions", [])
            for option in getattr(action, "option_strings", [])
            if "." in option and not option.endswith(".help")  # a group's flag (--model) is no typo's target
        ]
        flag = flags[0].split("=")[0] if flags else ""
        hint = did_you_mean(flag, accepted) if flag else ""
        if flag and "." not in flag and not hint:
            hint += f"\n  (a model's or data module's option is --model.init_args.{flag[2:]} or --data.init_args.{flag[2:]})"
        return f"unrecognized arguments: {args}{hint}\n  (`{prog} --help` lists the options)"
    no_class = _NO_CLASS.search(message)
    if no_class:
        return _describe_missing_class(message, no_class)
    if _PARSER_KEY.search(message) and "Expected a " in message:
        return _describe_bad_value(message)
    return _without_noise(message)


def _describe_missing_class(message: str, match: re.Match[str]) -> str:
    """``model: no class 'X'; did you mean Y?`` for a class path or short class name that imports nothing."""
    group = _group_of(message)
    name = match.group("name") or f"{match.group('module')}.{match.group('attr')}"
    short = name.rpartition(".")[2]
    module_name = _CLASS_MODULES.get(group)
    candidates: list[str] = []
    if module_name:
        module = importlib.import_module(module_name)
        candidates = [n for n in getattr(module, "__all__", dir(module)) if n[:1].isupper()]
    where = f"{group}: " if group else ""
    hint = f"\n  (a class of {module_name} by name, or any class by its import path)" if module_name else ""
    return f"{where}no class {name!r}" + did_you_mean(short, candidates) + hint


def _describe_bad_value(message: str) -> str:
    """``key: got 'value', expected T`` for jsonargparse's report of a value that is not of the key's type."""
    keys = _PARSER_KEY.findall(message)
    if _CLASS_PATH.search(message) and len(keys) > 1:
        keys = [keys[0], "init_args", *keys[1:]]
    innermost = _innermost_block(message)
    types, choices = [], []
    for type_text in re.findall(r"Expected a (.+?)(?:\. Got value: .*)?$", innermost, re.MULTILINE):
        described, values = _describe_type(type_text)
        if values or re.fullmatch(r"[\w.]+(\[[\w., \[\]]*\])?", described):  # not a parse failure's prose
            types.append("None" if described == "NoneType" else described)
            choices += values
    found = re.search(r"Got value: (.*)$|^\s*Given value: (.*)$", innermost, re.MULTILINE)
    value = next(v for v in found.groups() if v is not None).strip() if found else None
    got = f"got {value!r}, " if value is not None else ""
    suggestion = did_you_mean(value, choices, quote=True) if value is not None and choices else ""
    return f"{'.'.join(keys)}: {got}expected {' or '.join(dict.fromkeys(types))}{suggestion}"


def _innermost_block(message: str) -> str:
    """The lines of the last ``Parser key "..."`` entry of a nested report, up to the end of its indentation."""
    lines = message[message.rindex('Parser key "') :].splitlines()
    start = message[: message.rindex('Parser key "')].rsplit("\n", 1)[-1]
    indent = len(start) - len(start.lstrip())
    block = [lines[0]]
    for line in lines[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return "\n".join(block)


def _without_noise(message: str) -> str:
    """jsonargparse's message without the Union plumbing and the value dumps."""
    lines = [line for line in message.splitlines() if line.strip() and not _NOISE.match(line)]
    nested_keys = _PARSER_KEY.findall(message)
    given = _GIVEN_VALUE.findall(message)
    if given and len(nested_keys) <= 1 and len(given[-1]) <= 80:
        lines.append(f"  (given: {given[-1].strip()})")
    return "\n".join(lines) if lines else message


_WRAPPER = re.compile(r"^(Does not validate against any of the Union subtypes|Problem with given class_path)")


def raised_by_class(error: BaseException) -> BaseException:
    """What a class's ``__init__`` raised: jsonargparse wraps it in Union ``ValueError``s whose cause it is."""
    seen = {id(error)}
    while (
        type(error) is ValueError
        and _WRAPPER.match(str(error))
        and error.__cause__ is not None
        and id(error.__cause__) not in seen
    ):
        error = error.__cause__
        seen.add(id(error))
    return error


def install_command(error: BaseException) -> Optional[str]:
    """The one-line install command for an ``ImportError`` of an optional dependency (or one raised from
    such), else ``None``."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    imports = [e for e in chain if isinstance(e, ImportError)]
    if not imports:
        return None
    for err in imports:
        named = re.search(r"No module named '([\w.]+)'", str(err))
        module = (getattr(err, "name", None) or (named.group(1) if named else "")).split(".")[0]
        if module in _INSTALL:
            return _INSTALL[module]
        if module in _EXTRAS:
            return f'pip install "lightning-flce[{_EXTRAS[module]}]"'
    # a model's own message naming the extra; any other failed import is no optional dependency of ours
    extra = re.search(r"lightning-flce\[(\w+)\]", str(imports[0]))
    if extra:
        return _INSTALL.get(extra.group(1), f'pip install "lightning-flce[{extra.group(1)}]"')
    return None


def missing_module(error: BaseException) -> Optional[str]:
    """The name of the module whose import failed somewhere in ``error``'s chain, else ``None``."""
    current: Optional[BaseException] = error
    while current is not None:
        if isinstance(current, ImportError) and current.name:
            return current.name
        current = current.__cause__
    return None


def describe_instantiation_error(error: BaseException, groups: dict[str, str]) -> str:
    """A few lines for an exception raised while the classes of the config were built. ``groups`` maps the
    config's groups to their class paths (``{"model": "lightning_flce.models.TinyGPT", ...}``) to name the
    group whose class raised."""
    cause = raised_by_class(error)
    text = str(cause).strip() or type(cause).__name__
    class_path = re.search(r"class_path='([\w.]+)'", str(error))
    group = next((g for g, path in groups.items() if class_path and path == class_path.group(1)), None)
    if group is None and class_path:
        group = class_path.group(1)
    where = f"{group} ({groups[group]})" if group in groups else (group or "")
    command = install_command(cause)
    if command:
        missing = missing_module(cause)
        first = f"needs {missing}, which is not installed" if missing else text.split(":")[0]
        return (f"{where}: " if where else "") + f"{first}; install it with:\n  {command}"
    kind = type(cause).__name__
    return (f"{where}: " if where else "") + f"{kind}: {text}\n  ({DEBUG_ENV}=1 shows the traceback)"
