"""The pure core: key codec and keyspace, hashing and placement, row codec, initializers,
the service wire format and the optimizer math.

Imports numpy and the standard library only (msgpack for the wire format): no
asyncio, no network, no TensorFlow. Everything here is a plain function over
arrays, tested without servers.
"""
