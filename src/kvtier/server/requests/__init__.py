"""The server's request families: the handshake (Hello, Register), lookups, stores, retrieves
and sessions. Each holds its own state; the engine routes requests to them under its lock."""
