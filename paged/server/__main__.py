"""``python -m paged.server``: see `paged.server.cli`."""

from paged.server.cli import main

if __name__ == "__main__":
    main()
