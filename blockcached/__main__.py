"""`python -m blockcached`: the same as the `blockcached` script."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="blockcached")
