"""`python -m hybridspec ...` (and `torchrun ... -m hybridspec ...`): the `hybridspec` command."""
import sys

from .cli import main

sys.exit(main())
