"""The server's request families: the handshake (Hello, Register), lookups, stores, retrieves,
sessions and hand-offs. Each holds its own state; the routes call them, and each says what it
runs under the engine lock."""
