"""The `corectl` command line: `main.py` dispatches to one module per subcommand."""
