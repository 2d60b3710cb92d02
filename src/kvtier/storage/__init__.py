"""Where KV bytes live: the L1 index over the shared-memory arena (`l1`; the arena itself is
`kvtier.arena`), the cache policy, and the L2 tiers with the write and read paths between them."""
