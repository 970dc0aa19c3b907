"""``python -m paged.router``: see `paged.router.cli`."""

from paged.router.cli import main

if __name__ == "__main__":
    main()
