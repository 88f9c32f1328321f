"""Reference implementations and test clusters, used by the tests and benchmarks, never by training:
the NumPy embedding table that is the numba kernels' oracle (`embedding_reference`), a plain
PyTorch SASRec that is `psrec.models.sasrec`'s oracle (`sasrec_reference`), a Ray cluster of
several nodes on this machine (`local_cluster`) and a real Kafka-protocol broker on 127.0.0.1
(`kafka_broker`).
"""
