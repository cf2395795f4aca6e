"""Studies built on megatok: each a library the megatok-* commands call (tables, plots, verdicts)."""


class StudyError(ValueError):
    """Bad input to a study: the message is one line naming what is wrong (the command prints it)."""
