"""The command line and what it drives: the demo, method comparison, the HTML report."""
