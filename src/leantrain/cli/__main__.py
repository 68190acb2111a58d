"""`python -m leantrain.cli`: the `leantrain` command."""

from leantrain.cli import main

if __name__ == "__main__":
    main()
