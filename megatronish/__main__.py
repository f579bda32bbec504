from megatronish.cli import main

main()
