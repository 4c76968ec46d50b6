"""python -m zeroalloc summary [device]: print the memory summary of a fresh process's library
(mostly useful to check that the library loads and which device it drives)."""

import sys

import zeroalloc


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "summary":
        device = int(argv[1]) if len(argv) > 1 else 0
        print(zeroalloc.memory_summary(device))
        return 0
    print("usage: python -m zeroalloc summary [device]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
