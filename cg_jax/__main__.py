import sys

from cg_jax.cli import main

sys.exit(main())
