"""The Redis/Valkey L2 tier, shared by several machines: one value per object, pipelined batches.

Key names are `f"{prefix}:{{{model_hex}.{salt_hex}}}:{world_size}.{worker_id}.{chunk_hash_hex}"`.
The `{...}` part is a Redis Cluster hash tag: on a single server it only groups names; the
cluster tier (`redis_cluster`) lays keys out differently, so that one model spreads over every
node. The value is the shared object header (see `format`) followed by the payload.

GET, SET, EXISTS and DEL of objects go over the node's own pool in hand-packed RESP (`resp.Wire`,
no copies of values); SCAN, UNLINK and INFO go through redis-py. The batch engine here
(`_batch`) groups names by node and follows cluster redirects; on a single server there is one
node and a redirect is an error.

Removals the tier makes itself (a corrupt object deleted on read) are reported to the observer
the tier manager hands it; the server's own (TTL expiry, maxmemory eviction) are followed through
its keyspace notifications by `redis_watch` (single server only: a cluster's are not followed).

When Redis is unreachable every verb counts `errors` and behaves as a miss / no-op, then skips
the node for `cooldown` seconds (counted as `skipped`) so a dead server does not stall every
request; afterwards the connection pool reconnects by itself.

Its parts: `options` (the URL options both Redis tiers take), `clearing` (SCAN and UNLINK),
`batch` (the batch engine), `verbs` (`RespTier`: the object verbs both Redis tiers share) and
`tier` (`RedisTier`, the single-server tier).
"""

from kvtier.storage.tiers.redis.tier import RedisTier

__all__ = ["RedisTier"]
