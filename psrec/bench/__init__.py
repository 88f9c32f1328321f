"""`psrec bench`: psrec side by side with plain PyTorch, TorchRec and the dense-only ceiling.

The workload (`workload.Workload`) is the issue's DLRM on synthetic Criteo-shaped data; the systems
are in `torch_systems`, `psrec_systems` and `tf_system` (TensorFlow/Keras, optional, in a Python of
its own: `tf_dlrm`), listed with their precisions and baselines in `systems`; `harness.run_bench`
runs them in interleaved rounds and
`cli` is the CLI; `benchmarks/cpu_profile.py` breaks a step down by CPU time (1 thread) and `scaling` is the
N trainers x M shards throughput model of docs/scaling.md::

    psrec bench --dim 64 --rounds 3
    psrec bench --systems a,c,e --steps 6 --profile --json out.json
    python benchmarks/cpu_profile.py --dim 64
"""
