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


def command_parser(**kwargs) -> argparse.ArgumentParser:
    """Every command's argument parser: argparse's, with ``--version``."""
    parser = argparse.ArgumentParser(**kwargs)
    parser.add_argument("--version", action="version", version=f"%(prog)s (megatok) {version()}")
    return parser
