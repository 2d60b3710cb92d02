"""Where KV bytes live: the shared-memory arena and the L1 index over it (`arena`, `l1`), the
cache policy, and the L2 tiers with the write and read paths between them."""
