"""megatok's commands: one module per command, each with ``main(argv=None) -> int``, installed as
``megatok-<name>`` (pyproject.toml [project.scripts]; ``python -m megatok.cli.<name>`` runs the same).
Training itself is started with ``deepspeed launch/pretrain.py --config ...``."""

import argparse


def version() -> str:
    """megatok's version as installed (pyproject.toml's), or "unknown" from a checkout that is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("megatok")
    except PackageNotFoundError:
        return "unknown"


class CommandParser(argparse.ArgumentParser):
    """argparse's parser whose help gives every option's default (where it has one and its own help does not
    say it already)."""

    def format_help(self) -> str:
        for action in self._actions:
            text = action.help or ""
            if (not action.option_strings or action.default in (None, False, [], argparse.SUPPRESS)
                    or text == argparse.SUPPRESS or "default" in text.lower()):
                continue
            action.help = f"{text}{'; ' if text else ''}default: %(default)s"
        return super().format_help()


def command_parser(**kwargs) -> argparse.ArgumentParser:
    """Every command's argument parser: defaults in its help, and ``--version``. Commands share one spelling
    for what they share: ``--run`` (a run or export directory), ``--out`` (what they write), ``--checkpoint``
    (a checkpoint tag), ``--device`` (:func:`add_device`)."""
    parser = CommandParser(**kwargs)
    parser.add_argument("--version", action="version", version=f"%(prog)s (megatok) {version()}")
    return parser


def default_device() -> str:
    """Every command's default ``--device``: cuda when this machine has one, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(parser: argparse.ArgumentParser, what: str = "") -> None:
    """``--device``: cpu, cuda or cuda:N, checked (megatok.devices.device_option); default :func:`default_device`."""
    from megatok.devices import device_option

    parser.add_argument("--device", type=device_option, default=None,
                        help=f"{what}cpu, cuda or cuda:N (default: cuda when this machine has one, else cpu)")


def device_or_default(given: str | None) -> str:
    """The ``--device`` given, or :func:`default_device`."""
    return given or default_device()
