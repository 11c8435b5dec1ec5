"""`python -m nanosft ...` is the same door as the `nanosft` console script."""

from nanosft.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
