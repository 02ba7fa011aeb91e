"""Entry point: `python src/report.py sweep=<parent run id | name | latest> [tracking_uri=...] [out_dir=...]`."""

import sys

from rlhflab.report import main

if __name__ == "__main__":
    main(sys.argv[1:])
