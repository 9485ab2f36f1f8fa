"""Settings in layers: a TOML file, environment variables and flags, for any argparse parser.

How this works: the parser is the single list of settings.  Every option is a
key named by its long flag without the dashes in front (``--data-dir`` is
``data-dir``, spelled with ``-`` as on the command line; ``data_dir`` is an
unknown key whose error names the right spelling) and an environment variable
``<PREFIX><KEY>`` with ``-`` as ``_`` in capitals (``CLONE_SERVER_DATA_DIR``).
So a flag a later change adds to the parser is a key and a variable at once.
A switch (``store_true``, ``--x/--no-x``) is a boolean, a list option (``append``,
``nargs="+"``) a list of strings (in a variable, comma-separated), any other a
string, or a number when the flag has a type.  An action no such value stands
for (``count``, a custom one) stays a flag only: :func:`unsupported_options`
names them, and the commands' tests require there be none.

:func:`parse_layered` parses the command line first, into a namespace where
every option holds a marker, so the options the command line gave are exactly
those that lost their marker (argparse keeps a value already on the namespace
instead of its default).  Then each other option takes the environment's value,
else the file's, else its default: flags > environment > file > default.  A file's
or variable's value goes through the flag's own ``type`` and ``choices``, so a bad
one is refused with the same words, naming the key or variable.

A mutually exclusive group (the server's role, ``--data-dir``/``--in-memory``) and
any ``together`` bundle (the client's CURVE pair) is taken whole from the highest
layer that sets one of its members: ``--backup`` on the command line overrides
``primary = true`` in the file instead of colliding with it.

Environment variables with the prefix that name no option are ignored, not
refused: ``CLONE_SERVER_KEY`` is the ``clone`` command's, and a variable left in a
shell must not stop a server from starting.  Unknown keys in a file are refused:
a file is written for this program, and a typo there would silently do nothing.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clone.errors import ConfigError

__all__ = [
    "Layered",
    "Origin",
    "Source",
    "add_config_flags",
    "env_name",
    "option_keys",
    "parse_layered",
    "resolve",
    "unsupported_options",
]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_OWN = frozenset({"config", "print_config"})  # the dests of add_config_flags


class Source(enum.Enum):
    """Where an effective setting came from, lowest precedence first."""

    DEFAULT = "default"
    FILE = "file"
    ENV = "environment"
    FLAG = "flag"


@dataclass(frozen=True, slots=True)
class Origin:
    """A setting's source and its place there: a path, a variable or a flag."""

    source: Source
    where: str = ""

    def __str__(self) -> str:
        return self.source.value if not self.where else f"{self.source.value} {self.where}"


class _Kind(enum.Enum):
    """How a file or a variable spells an option's value."""

    SWITCH = "switch"  # store_true/store_false/store_const, --x/--no-x: a boolean
    SCALAR = "scalar"  # one value: a string, or a number for a typed option
    LIST = "list"  # append, extend, nargs="+": a list of strings; a variable's, comma-separated


@dataclass(frozen=True, slots=True)
class _Option:
    key: str
    action: argparse.Action
    kind: _Kind

    @property
    def dest(self) -> str:
        return self.action.dest

    @property
    def flag(self) -> str:
        return f"--{self.key}"


@dataclass(frozen=True, slots=True)
class Layered:
    """The parsed namespace and, per key, where its value came from."""

    args: argparse.Namespace
    origins: dict[str, Origin]
    dests: dict[str, str]
    config: str | None
    env_prefix: str

    def given(self, key: str) -> bool:
        """True when ``key`` came from a flag, the environment or the file."""
        return self.origins[key].source is not Source.DEFAULT

    def log_sources(self, logger: logging.Logger) -> None:
        """One INFO line at start naming the file and the variables read, so a
        setting that is not on the command line can be traced from the log."""
        from_env = [o.where for o in self.origins.values() if o.source is Source.ENV]
        if self.config is not None:
            logger.info("settings from %s, under flags and %s* variables",
                        self.config, self.env_prefix)
        if from_env:
            logger.info("settings from the environment: %s", ", ".join(from_env))

    def render(self, title: str) -> str:
        """The effective settings, one ``key = value  # origin`` line each.

        Values are shown as the namespace holds them: a certificate or an ACL
        is a path here, and this never opens it, so secrets are never shown.
        """
        lines = [f"# {title}: flag > environment ({self.env_prefix}*) > file > default"]
        rows = []
        for key, origin in self.origins.items():
            value = getattr(self.args, self.dests[key], None)
            if value is None:
                rows.append((f"# {key} is unset", str(origin)))
            else:
                rows.append((f"{key} = {_toml(value)}", str(origin)))
        width = max(len(left) for left, _ in rows)
        lines += [f"{left.ljust(width)}  # {right}" for left, right in rows]
        return "\n".join(lines)


def env_name(prefix: str, key: str) -> str:
    """The environment variable of ``key``: ``CLONE_SERVER_`` + ``data-dir`` is
    ``CLONE_SERVER_DATA_DIR``."""
    return prefix + key.upper().replace("-", "_")


def add_config_flags(parser: argparse.ArgumentParser, *, env_prefix: str) -> None:
    """``--config FILE`` and ``--print-config``, for :func:`parse_layered`."""
    group = parser.add_argument_group(
        "configuration",
        "settings from a file and the environment: flags > environment > file"
        " (docs/deploy.md, 'Configuration')",
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        help=f"read settings from this TOML file, one key per flag, spelled as the flag"
        f" (data-dir = \"/var/lib/clone\"; primary = true) (default: ${env_prefix}CONFIG)",
    )
    group.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings and where each came from, then exit",
    )


def option_keys(parser: argparse.ArgumentParser) -> list[str]:
    """Every key the parser's options give a file or the environment, in order."""
    return [o.key for o in _options(parser)]


def unsupported_options(parser: argparse.ArgumentParser) -> list[str]:
    """The flags left to the command line: actions no file value can stand for
    (``count``, ``append`` of several values, custom actions).  The commands'
    tests require this to be empty, so a new flag of such a kind is noticed."""
    return [f"--{_key(a)}" for a in _candidates(parser) if _kind(a) is None]


def parse_layered(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    *,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
    together: Sequence[Sequence[str]] = (),
) -> Layered:
    """Parse ``argv`` over the environment over ``--config``; usage errors exit 2.

    ``together`` names bundles of keys taken from one layer (see the module's
    docstring).  A required option or group may be met by any layer; a
    required subcommand is not required with ``--print-config``.
    """
    try:
        return resolve(parser, argv, env_prefix=env_prefix, environ=environ, together=together)
    except ConfigError as exc:
        parser.error(str(exc))


def resolve(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    *,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
    together: Sequence[Sequence[str]] = (),
) -> Layered:
    """As :func:`parse_layered`, raising :class:`ConfigError` for bad layers."""
    environ = os.environ if environ is None else environ
    options = _options(parser)
    by_key = {o.key: o for o in options}
    for bundle in together:
        for key in bundle:
            if key not in by_key:
                raise ValueError(f"together names {key!r}, which is no option of the parser")
    args, given = _parse_flags(parser, argv, options)

    config = getattr(args, "config", None)
    config_origin = Origin(Source.FLAG, "--config")
    if config is None and environ.get(env_name(env_prefix, "config"), "").strip():
        config = environ[env_name(env_prefix, "config")].strip()
        config_origin = Origin(Source.ENV, env_name(env_prefix, "config"))
    layers: list[tuple[Origin, dict[str, Any]]] = [
        (Origin(Source.FLAG), {o.key: getattr(args, o.dest) for o in options if o.key in given}),
        (Origin(Source.ENV), _from_env(options, env_prefix, environ)),
    ]
    if config is not None:
        flag_only = unsupported_options(parser)
        layers.append((Origin(Source.FILE, config), _from_file(options, config, flag_only)))

    origins: dict[str, Origin] = {}
    bundles = [[o.key for o in options if o.action in group._group_actions]
               for group in parser._mutually_exclusive_groups]
    bundles += [list(b) for b in together]
    bundled: set[str] = set()
    for bundle in bundles:
        keys = [k for k in bundle if k in by_key]
        bundled.update(keys)
        for origin, values in layers:
            if any(_sets(by_key[k], values[k]) for k in keys if k in values):
                for k in keys:
                    if k in values:
                        origins[k] = _where(origin, by_key[k], env_prefix)
                        setattr(args, by_key[k].dest, values[k])
                break
    for option in options:
        if option.key in bundled:
            continue
        for origin, values in layers:
            if option.key in values:
                origins[option.key] = _where(origin, option, env_prefix)
                setattr(args, option.dest, values[option.key])
                break
    for option in options:
        if option.key not in origins:
            origins[option.key] = Origin(Source.DEFAULT)
            setattr(args, option.dest, _default(option))
    origins = {o.key: origins[o.key] for o in options}  # in the parser's order
    if "config" in args:
        origins = {"config": config_origin if config else Origin(Source.DEFAULT), **origins}
        args.config = config
    _check_groups(parser, options, origins, args)
    if not getattr(args, "print_config", False):
        _check_required(parser, args)
    dests = {"config": "config", **{o.key: o.dest for o in options}}
    return Layered(
        args=args, origins=origins, dests=dests, config=config, env_prefix=env_prefix
    )


def _candidates(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a for a in parser._actions
        if a.option_strings and a.dest not in _OWN
        and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
    ]


def _key(action: argparse.Action) -> str:
    longs = [s for s in action.option_strings if s.startswith("--")]
    return longs[0][2:] if longs else action.dest.replace("_", "-")


def _kind(action: argparse.Action) -> _Kind | None:
    if isinstance(action, argparse._StoreConstAction | argparse.BooleanOptionalAction):
        return _Kind.SWITCH
    if isinstance(action, argparse._ExtendAction):  # before append: it is one
        return _Kind.LIST if action.nargs in ("+", "*") else None
    if isinstance(action, argparse._AppendAction):
        return _Kind.LIST if action.nargs is None else None
    if isinstance(action, argparse._StoreAction):
        if action.nargs in (None, "?"):
            return _Kind.SCALAR
        return _Kind.LIST if action.nargs in ("+", "*") else None
    return None


def _options(parser: argparse.ArgumentParser) -> list[_Option]:
    out = []
    for action in _candidates(parser):
        kind = _kind(action)
        if kind is not None:
            out.append(_Option(key=_key(action), action=action, kind=kind))
    return out


class _Unset:
    """The marker of an option the command line did not give."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET = _Unset()


def _parse_flags(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, options: list[_Option]
) -> tuple[argparse.Namespace, set[str]]:
    """The command line alone, with nothing required: the layers may fill it in."""
    namespace = argparse.Namespace()
    markers: dict[str, object] = {}
    for option in options:
        # An append action copies a list it finds; a fresh list is its marker.
        marker: object = [] if option.kind is _Kind.LIST else _UNSET
        markers[option.dest] = marker
        setattr(namespace, option.dest, marker)
    saved = [(a, a.required) for a in parser._actions]
    saved_groups = [(g, g.required) for g in parser._mutually_exclusive_groups]
    try:
        for action in parser._actions:
            action.required = False
        for group in parser._mutually_exclusive_groups:
            group.required = False
        args = parser.parse_args(argv, namespace)
    finally:
        for action, required in saved:
            action.required = required
        for group, required in saved_groups:
            group.required = required
    given = {o.key for o in options if getattr(args, o.dest) is not markers[o.dest]}
    return args, given


def _from_env(
    options: list[_Option], prefix: str, environ: Mapping[str, str]
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for option in options:
        name = env_name(prefix, option.key)
        text = environ.get(name, "").strip()
        if not text:
            continue  # unset and empty are the same, as $CLONE_SERVERS always was
        if option.kind is _Kind.SWITCH:
            word = text.lower()
            if word not in _TRUE | _FALSE:
                raise ConfigError(
                    f"environment {name}: expected 1/true/yes/on or 0/false/no/off, got {text!r}"
                )
            values[option.key] = _switch(option, word in _TRUE)
        elif option.kind is _Kind.LIST:
            parts = [p.strip() for p in text.split(",") if p.strip()]
            values[option.key] = [_convert(option, p, f"environment {name}") for p in parts]
        else:
            values[option.key] = _convert(option, text, f"environment {name}")
    return values


def _from_file(options: list[_Option], path: str, flag_only: list[str]) -> dict[str, Any]:
    import tomllib  # only with --config: every server and command line starts without it

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    by_key = {o.key: o for o in options}
    unknown = [k for k in data if k not in by_key]
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown {'key' if len(unknown) == 1 else 'keys'} "
            + ", ".join(_unknown(k, list(by_key), flag_only) for k in unknown)
        )
    values: dict[str, Any] = {}
    for key, raw in data.items():
        option = by_key[key]
        where = f"config file {path}: {key}"
        action = option.action
        if option.kind is _Kind.SWITCH:
            if not isinstance(raw, bool):
                raise ConfigError(f"{where}: expected true or false, got {_kind_of(raw)}")
            values[key] = _switch(option, raw)
        elif option.kind is _Kind.LIST:
            items = [raw] if isinstance(raw, str) else raw
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ConfigError(f"{where}: expected a list of strings, got {_kind_of(raw)}")
            values[key] = [_convert(option, i, where) for i in items]
        else:
            numeric = action.type is not None and isinstance(raw, int | float)
            if isinstance(raw, bool) or not (isinstance(raw, str) or numeric):
                wanted = "a string or a number" if action.type is not None else "a string"
                raise ConfigError(f"{where}: expected {wanted}, got {_kind_of(raw)}")
            values[key] = _convert(option, str(raw), where)
    return values


def _unknown(key: str, known: list[str], flag_only: list[str]) -> str:
    dashed = key.replace("_", "-")
    if f"--{dashed}" in flag_only:
        return f"{key} (--{dashed} is a flag only)"
    if dashed in known:
        return f"{key} (spelled {dashed}, as the flag)"
    close = difflib.get_close_matches(key, known, n=1)
    return f"{key} (did you mean {close[0]}?)" if close else key


def _kind_of(raw: object) -> str:
    if isinstance(raw, bool):
        return f"a boolean ({str(raw).lower()})"
    if isinstance(raw, dict):
        return "a table (settings are top-level keys)"
    return f"{type(raw).__name__} {raw!r}"


def _convert(option: _Option, text: str, where: str) -> Any:
    """The flag's own type and choices, so the file and the flag agree on what is valid."""
    action = option.action
    value: Any = text
    if action.type is not None:
        convert: Any = action.type
        try:
            value = convert(text)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (TypeError, ValueError):
            name = getattr(convert, "__name__", "value")
            raise ConfigError(f"{where}: invalid {name} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: invalid choice {text!r} (choose from {choices})")
    return value


def _sets(option: _Option, value: Any) -> bool:
    """Whether a layer's value sets a bundle: ``primary = false`` does not."""
    if isinstance(option.action, argparse._StoreConstAction):
        return bool(value == option.action.const)
    return value is not None  # a value, or --x/--no-x either way


def _switch(option: _Option, on: bool) -> Any:
    """A switch's value: store_true's True, store_false's False, --x/--no-x's own."""
    action = option.action
    if isinstance(action, argparse._StoreConstAction):
        return action.const if on else action.default
    return on


def _where(origin: Origin, option: _Option, prefix: str) -> Origin:
    if origin.source is Source.FLAG:
        return Origin(Source.FLAG, option.flag)
    if origin.source is Source.ENV:
        return Origin(Source.ENV, env_name(prefix, option.key))
    return origin


def _default(option: _Option) -> Any:
    default = option.action.default
    if isinstance(default, str) and option.action.type is not None:
        return _convert(option, default, f"default of {option.flag}")
    return default


def _check_groups(
    parser: argparse.ArgumentParser,
    options: list[_Option],
    origins: dict[str, Origin],
    args: argparse.Namespace,
) -> None:
    for group in parser._mutually_exclusive_groups:
        members = [o for o in options if o.action in group._group_actions]
        chosen = [
            o for o in members
            if origins[o.key].source is not Source.DEFAULT and _sets(o, getattr(args, o.dest))
        ]
        if len(chosen) > 1:
            raise ConfigError(
                "only one of "
                + ", ".join(f"{o.key} ({origins[o.key]})" for o in chosen)
                + " may be set"
            )
        if group.required and not chosen and not getattr(args, "print_config", False):
            flags = " ".join(o.flag for o in members)
            raise ConfigError(
                f"one of the arguments {flags} is required (a flag, its environment"
                " variable or its key in --config)"
            )


def _check_required(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for action in parser._actions:
        if action.required and getattr(args, action.dest, None) in (None, _UNSET):
            name = action.metavar if isinstance(action.metavar, str) else action.dest
            raise ConfigError(f"the following arguments are required: {name}")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
