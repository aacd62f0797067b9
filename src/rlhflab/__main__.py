import sys

from rlhflab.cli import main

sys.exit(main())  # the command's exit status, as the installed `rlhflab` script returns it
