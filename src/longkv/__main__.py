"""`python -m longkv`: the `longkv` command."""

import sys

from longkv.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
