"""Where KV bytes live: the shared-memory arena and L1 index (`arena`, `l1`) and the L2 tiers."""
