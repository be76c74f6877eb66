"""`python -m kvmesh.cluster.cli ...`: the `kvmesh` command."""
import sys

from kvmesh.cluster.cli import main

sys.exit(main())
