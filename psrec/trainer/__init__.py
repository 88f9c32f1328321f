"""What runs inside a trainer process: the worker actor (`worker.TrainerWorker`), one training step
(`step`, `pipeline_step`: pull -> forward/backward -> push, overlapped with the next batch's plan),
the sparse lookup and pooling (`lookup`, `pooling`, `bag_pooling`), the dense optimizer, the device
copies, the chunk of steps it reports (`chunks`), evaluation metrics (`metrics`) and the builders that
turn a run config into a model and table specs (`builders`).

The driver (`psrec.train`) creates trainers in its own process or as Ray actors and calls them
through `psrec.cluster.groups.TrainerGroup`.
"""
