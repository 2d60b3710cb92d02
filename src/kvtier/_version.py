"""The package version, in a module of its own so the server and CLI read it without importing
the package face (`kvtier/__init__.py` pulls in the client, numpy and zmq)."""

__version__ = "0.1.0"
