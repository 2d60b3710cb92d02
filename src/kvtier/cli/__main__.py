"""`python -m kvtier.cli`: the `kvtier` command."""

from kvtier.cli.main import main

main()
