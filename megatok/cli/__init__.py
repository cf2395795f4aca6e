"""Command-line tools: one module per command, each with main(argv=None) -> int."""
