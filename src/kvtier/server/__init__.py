"""The kvtier server: the request engine (engine, routes, requests), the ZMQ loop (transport),
what it reports (observe: the admin API, metrics, KV events), and their assembly into one
process (app). See README.md here."""
