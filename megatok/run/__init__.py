"""Reading a run directory, with no engine and no process group: its checkpoints (which are published,
damage, the resume choice: checkpoints), whether a checkpoint is the model a config builds (same_model),
its config and model (reader: the ZeRO partitions merged) and exports (export); and the lock that keeps
it to one writer (lock). Nothing here imports the trainer (megatok.train), which writes the run directory."""
