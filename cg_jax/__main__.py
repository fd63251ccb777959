"""`python -m cg_jax` (and the `cg-jax` command): the command line (`cg_jax.cli`).

For `serve`, the engine-core process starts before the command line is imported
(`cg_jax.core.prestart`): it imports jax and the engine while this process imports the rest.
"""

import sys

from cg_jax.core import prestart


def main() -> int:
  if sys.argv[1:2] == ["serve"]:
    prestart.start()
  from cg_jax.cli import main as cli_main  # (after the core's start: the point of this module)
  return cli_main()


if __name__ == "__main__":
  sys.exit(main())
