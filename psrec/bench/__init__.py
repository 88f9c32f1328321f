"""Benchmarks: the `psrec bench` command and the measurement scripts behind the docs' figures.

`psrec bench` runs psrec side by side with plain PyTorch, TorchRec and the dense-only ceiling. The
workload (`workload.Workload`) is the issue's DLRM on synthetic Criteo-shaped data; the systems are in
`torch_systems`, `psrec_systems` and `tf_system` (TensorFlow/Keras, optional, in a Python of its own:
`tf_dlrm`), listed with their precisions and baselines in `systems`; `harness.run_bench` runs them in
interleaved rounds, `cli` is the command, `plot` draws its throughput figure and `throughput_model` is
the N trainers x M shards throughput model of docs/scaling.md::

    psrec bench --dim 64 --rounds 3
    psrec bench --systems a,c,e --steps 6 --profile --json out.json
    python -m psrec.bench.throughput_model docs/data/scaling.json

The other modules are measurement scripts, each run as ``python -m psrec.bench.<name> --help`` from
a checkout (several read configs from its ``examples/``, `EXAMPLES`); their figures are in
docs/benchmarks.md unless noted:

- a step and the embedding engine: `cpu_profile` (a step's CPU time by piece, 1 thread),
  `embedding_bench` (hash table lookups and fused optimizer updates against torch's EmbeddingBag),
  `input_bench` (TSV parse, Parquet read, batches delivered), `running_auc_bench` (the driver's
  running AUC), `accounting_bench` (the exactly-once id ranges at a checkpoint);
- the parameter server: `ps_bench` (in-process against Ray layouts), `shard_reads_bench` and
  `shared_write_bench` (the shard's and the trainer's side of a shared-memory pull and push),
  `ray_start_bench` (starting the embedded Ray cluster and its actors);
- the disk tier: `disk_store_choice` (LMDB, RocksDB or a slab file for cold rows), `disk_tier_bench`
  (demotion policies' hit rates, a table larger than its memory budget; docs/disk_tier.md too);
- recovery and elasticity (docs/fault_tolerance.md): `recovery_bench` (a killed trainer or shard),
  `failover_bench` (shard failover against rollback), `shard_recovery_bench` (one shard of N rows),
  `reshard_bench` (changing the shard count while training), `trainer_scale_bench` (changing the
  trainer count);
- clusters, parallelism and serving: `cluster_bench` and `store_read_bench` (a three-node local
  cluster, data on an object store; docs/cluster.md), `parallel_bench` (collective sharding and
  pipeline parallelism; docs/parallelism.md), `hstu_pipeline_bench` (HSTU tokens/s for 1, 2, 4
  pipeline stages; docs/results.md), `serve_load` (`psrec serve` under load; docs/serving.md);
- model quality: `sasrec_oracle` (the plain PyTorch SASRec oracle trained on a real data set;
  docs/results.md).

Nothing else in psrec imports this package except `psrec.cli`.
"""

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
"""The checkout's example configs, which the scripts that train the quickstart or Frappe job read."""
