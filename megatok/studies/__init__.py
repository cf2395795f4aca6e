"""Studies built on megatok: each a library the megatok-* commands call (tables, plots, verdicts)."""
