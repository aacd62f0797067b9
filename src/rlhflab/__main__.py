import sys

from rlhflab.app.cli import main

sys.exit(main())  # the command's exit status, as the installed `rlhflab` script returns it
