"""`python -m retrace ...` runs the `retrace` command line (retrace/cli.py)."""

from retrace.cli import main

if __name__ == "__main__":
    main()
