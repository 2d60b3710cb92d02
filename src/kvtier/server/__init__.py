"""The kvtier server: request handlers (engine), the ZMQ loop (transport), the admin API (admin),
and their assembly into one process (app)."""
