"""``python -m edge_agent ...``: start an agent without loading the other packages' commands."""
import sys

from .cli import main

sys.exit(main())
