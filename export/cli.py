"""keras-bn-export: command-line entry point (a stub until the export module lands)."""

import sys


def main(argv=None):
    print("keras-bn-export: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
