"""What gateways and workers must agree on, and nothing else.

- ``hashing``: the block-hash chain (``HashSpec``, ``block_hashes``).
- ``events``: KV cache events and their wire encoding (``EventBatch``).
- ``redis_layout``: Redis key names and the worker registry record.
- ``worker_pb2`` / ``worker_pb2_grpc`` / ``kv_events_pb2``: stubs generated
  from ``proto/`` by ``proto/generate.py``.
"""
