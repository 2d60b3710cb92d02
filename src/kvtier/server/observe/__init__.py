"""What the server tells the outside: typed snapshots of its state (`snapshots`, built by
`views`), Prometheus metrics, the admin API and status page, KV events for routers, and the
reason for every missed token."""
