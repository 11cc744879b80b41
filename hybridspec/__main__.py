"""`python -m hybridspec ...` (and `torchrun ... -m hybridspec ...`): the `hybridspec` command."""
import sys

from hybridspec.cli.main import main

sys.exit(main())
