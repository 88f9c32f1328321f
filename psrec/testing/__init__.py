"""Reference implementations and test clusters, used by the tests and benchmarks, never by training:
the NumPy embedding table that is the numba kernels' oracle (`embedding_reference`), a plain
PyTorch SASRec that is `psrec.models.sasrec`'s oracle (`sasrec_reference`) and a Ray cluster of
several nodes on this machine (`local_cluster`).
"""
