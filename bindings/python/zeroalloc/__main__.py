"""python -m zeroalloc doctor | summary [device] | report prefix.json | library | settings

doctor: checks the set-up (driver, runtime, GPUs, pinned memory, io_uring, NUMA, NCCL,
PyTorch, every ZEROALLOC_* variable) and prints what to do; exits non-zero on a failure.
summary: prints the memory summary of a fresh process's library (shows that it loads and
which device it drives).
report: prints a report's summary and rebuilds its page from the JSON.
library: prints the path of the libzeroalloc.so the package uses, for
    LD_PRELOAD=$(python -m zeroalloc library) python train.py
settings: prints the settings reference (docs/settings.md) from the library's options table."""

import sys

import zeroalloc


def main(argv: list[str]) -> int:
    if argv[:1] == ["report"]:
        from zeroalloc import report

        return report.main(argv[1:])
    if argv[:1] == ["doctor"]:
        from zeroalloc import doctor

        return doctor.main()
    if argv == ["library"]:
        from zeroalloc._library import ZeroallocError, library_path

        try:
            print(library_path())
        except ZeroallocError as error:
            print(f"zeroalloc: {error}", file=sys.stderr)
            return 1
        return 0
    if argv == ["settings"]:
        from zeroalloc import settings

        return settings.main()
    if len(argv) >= 1 and argv[0] == "summary":
        device = int(argv[1]) if len(argv) > 1 else 0
        print(zeroalloc.memory_summary(device))
        return 0
    print("usage: python -m zeroalloc doctor | summary [device] | report prefix.json | library"
          " | settings",
          file=sys.stderr)
    return 2


def entry_point() -> int:
    """The `zeroalloc` command the package installs."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
