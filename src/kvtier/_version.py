"""kvtier's version, in a module of its own so the server and the build read it without importing
the package face (`kvtier/__init__.py` pulls in the client)."""

__version__ = "0.1.0"
