"""`python -m megatronish`: the same command group as the `megatronish` script."""

from megatronish.cli import main

main()
