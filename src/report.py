"""Entry point: `python src/report.py sweep=<parent run id | name | latest> [tracking_uri=...] [out_dir=...]`."""

import sys

from rlhflab.report import cli

if __name__ == "__main__":
    cli(sys.argv[1:])
