"""`python -m corectl.server.cli`, the same as the `corectl` script."""
import sys

from .main import main

sys.exit(main())
