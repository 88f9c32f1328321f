"""Hybrid and model parallelism beyond the parameter server (docs/parallelism.md says when to use which).

Modules, by concept:

- ``planner``: the sharding planner, a pure function (table sizes, devices, strategy -> placement,
  memory and traffic per device, or a refusal saying why); ``plan_spec`` reads its YAML input and
  ``cli`` is ``psrec plan SPEC``.
- ``placement``: which rank owns each id under collective sharding (table-wise or row-wise by bucket).
- ``exchange``: variable-sized all-to-all of NumPy arrays over ``torch.distributed``.
- ``collective``: ``CollectiveConnection``, the trainers holding the tables themselves; a
  ``ShardConnection``, so the ``EmbeddingClient`` and ``StepRunner`` are unchanged.
- ``pipeline``: SASRec/BST split into stages with ``torch.distributed.pipelining`` (GPipe or 1F1B),
  data-parallel across pipeline replicas.
- ``launch``: ``run_local_group``, W forked processes in a gloo group (tests, measurements).
- the side-by-side figures of the docs come from `psrec/bench/parallel_bench.py`.

Import from the modules (``from psrec.parallel.planner import plan_sharding``): this package file
imports nothing, so `psrec --help` stays fast.
"""
