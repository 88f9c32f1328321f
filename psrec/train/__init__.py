"""The driver: the training loop (`loop.train`), where the shards and trainers run (`runtime`:
in this process or as Ray actors), evaluation and early stopping, reporting (progress, TensorBoard,
`summary.json`), checkpoints and restarts (`checkpointing`), the run directory, exactly-once
accounting of the rows consumed, the data sources a run prepares, and the `psrec train` command
(`cli`).
"""
