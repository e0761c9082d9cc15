"""``python -m superkernel ...`` is the ``superkernel`` command."""
import sys

from superkernel.cli import main

sys.exit(main())
