"""What runs inside a trainer process: the worker actor (`worker.TrainerWorker`), one training step
(`step`, `pipeline_step`: pull -> forward/backward -> push, overlapped with the next batch's plan),
the sparse lookup and pooling (`lookup`, `pooling`, `bag_pooling`), the dense optimizer, the device
copies, the chunk of steps it reports (`chunks`), the readers of its share of the data (`readers`),
evaluation metrics (`metrics`) and the builders that turn a run config into a model, table specs and a
step runner (`builders`).

The driver (`psrec.train`) creates trainers in its own process or as Ray actors and calls them
through `psrec.cluster.groups.TrainerGroup`.
"""
