"""``python -m lightning_flce fit --config default``: same as the ``lightning-flce`` command."""

from lightning_flce.cli import main

if __name__ == "__main__":
    main()
