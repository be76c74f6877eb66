"""`python -m cluster.cli ...`: the `kvmesh` command."""
import sys

from cluster.cli import main

sys.exit(main())
