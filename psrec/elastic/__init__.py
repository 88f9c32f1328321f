"""The job changing shape while it runs: a killed shard rebuilt alone (`shard_failover`), a killed
trainer replaced (`trainer_failover`), the shard count changed live (`resharding` with the runtime's
shards as a `shard_set`, or automatically by `autoscale`), the trainer count changed live
(`trainer_scaling`), and the `psrec scale` command (`cli`).

Decisions (which buckets move, whether a request fits, where a replaced trainer resumes) are pure
functions over plain data; the machinery reaches the running job through the runtime's public API
(`psrec.elastic.runtime_api.ElasticRuntime`).
"""
