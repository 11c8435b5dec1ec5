"""`python -m nanosft ...` is the same door as the `nanosft` console script."""

try:
    from nanosft.cli import main
except KeyboardInterrupt:  # Ctrl-C while still importing: nothing ran, so no traceback
    raise SystemExit(130) from None

if __name__ == "__main__":
    raise SystemExit(main())
