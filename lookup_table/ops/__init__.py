"""Operating a cluster: checkpoints, `lookup-table-admin`, local memcached processes.

    checkpoint/    save, restore, verify and export checkpoints (`lookup-table-checkpoint`)
    admin.py       init and reinit a namespace's sentinels (`lookup-table-admin`)
    stats.py       keys and bytes per table and node (`lookup-table-admin stats`)
    metadump.py    the lines of one namespace in an `lru_crawler metadump` reply
    localcluster/  start and stop local memcached and replicas (`deploy/cluster.sh`)

This layer sits on top of `lookup_table.store` and `lookup_table.memcached`;
nothing below it imports it. Importing this package imports none of its modules.
"""
