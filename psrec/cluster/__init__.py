"""The processes of a job: Ray's start and stop on an embedded loopback cluster or a joined one
(`start`), where actors run (`placement`), and the typed calls from the driver to groups of trainers
and shards, in this process or as Ray actors (`groups`).
"""
