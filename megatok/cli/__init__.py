"""megatok's commands: one module per command, each with ``main(argv=None) -> int``, installed as
``megatok-<name>`` (pyproject.toml [project.scripts]; ``python -m megatok.cli.<name>`` runs the same).
Training itself is started with ``deepspeed launch/pretrain.py --config ...``."""
