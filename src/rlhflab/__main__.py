from rlhflab.cli import main

main()
