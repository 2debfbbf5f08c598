"""The one memcached transport: the meta protocol codec, pooled pipelined round trips,
and the commands beyond rows (stats, metadump, deletes).

`protocol` (requests) and `replies` are pure (bytes in, numpy out; tested without
servers); `node` owns the connections and their deadlines; `batch` is one node's request
of a store batch; `commands` runs single commands on connections of their own. The
store, checkpoints and `lookup-table-admin` all go through here.
"""
